"""CurveZMQ on the client-facing sockets: encryption, and clients authenticated by their keys.

Keys are pyzmq's certificate files, as `zmq.auth.create_certificates(folder, name)` writes them:
`name.key_secret` holds a key pair, `name.key` its public key alone, both in Z85 text. The server
takes its pair (--zmq-curve-secret-key-file) and a folder of the public certificates of the
clients it admits (--zmq-curve-allowed-clients, every `*.key` in it); a ZAP handler thread in
each process that binds a client-facing socket (the tokenizer's and the detokenizer's ROUTERs)
refuses any other key during the handshake, so an unknown client's frames never reach Baton. The
server's own key is admitted too: the HTTP frontend is a client of those sockets and uses it.
Knowing the server's public key is not enough to connect (it is public, and published to every
client); a client needs a key pair of its own that the server lists, which can be revoked alone.
A client gives `BatonClient` the server's public key and its own pair (`CurveClientKeys`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from baton.config import BatonConfig, ConfigurationError

CURVE_KEY_BYTES = 32


class CurveKeyPair(NamedTuple):
    """A CurveZMQ key pair in Z85 text."""

    public: bytes
    secret: bytes


def load_key_pair(path: str, flag: str) -> CurveKeyPair:
    """The key pair in a `*.key_secret` certificate; ConfigurationError, in one line naming
    `flag` and the file, when it holds none."""
    public, secret = _load_certificate(path, flag)
    if secret is None:
        raise ConfigurationError(
            f"{flag} {path}: no secret-key in it (a public certificate? give the .key_secret "
            "file zmq.auth.create_certificates wrote)"
        )
    _check_key(secret, path, flag)
    if zmq.curve_public(secret) != public:
        raise ConfigurationError(f"{flag} {path}: its public-key is not its secret-key's")
    return CurveKeyPair(public, secret)


def load_public_key(path: str, flag: str) -> bytes:
    """The public key in a certificate (either kind); ConfigurationError as `load_key_pair`."""
    return _load_certificate(path, flag)[0]


def load_allowed_clients(directory: str) -> frozenset[bytes]:
    """The public keys of the clients' certificates (`*.key`) in --zmq-curve-allowed-clients;
    ConfigurationError for a folder that is missing or lists none."""
    flag = "--zmq-curve-allowed-clients"
    if not os.path.isdir(directory):
        raise ConfigurationError(f"{flag} {directory}: not a folder")
    paths = sorted(name for name in os.listdir(directory) if name.endswith(".key"))
    if not paths:
        raise ConfigurationError(
            f"{flag} {directory}: no client certificate (*.key) in it, so no client could connect"
        )
    return frozenset(load_public_key(os.path.join(directory, name), flag) for name in paths)


@dataclass(frozen=True)
class CurveClientKeys:
    """What a client needs to reach a server that speaks CurveZMQ: the server's public key and
    a key pair of its own that the server admits."""

    server_public_key: bytes
    client: CurveKeyPair

    @classmethod
    def from_files(cls, server_certificate: str, client_certificate: str) -> CurveClientKeys:
        """From the server's public certificate (`server.key`) and the client's own key pair
        (`client.key_secret`)."""
        return cls(
            load_public_key(server_certificate, "the server's certificate"),
            load_key_pair(client_certificate, "the client's certificate"),
        )

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` a CurveZMQ client of the server (before it connects)."""
        socket.curve_serverkey = self.server_public_key
        socket.curve_publickey = self.client.public
        socket.curve_secretkey = self.client.secret


@dataclass(frozen=True)
class CurveServerKeys:
    """A server's CurveZMQ keys: its pair, and the public keys of the clients it admits."""

    pair: CurveKeyPair
    allowed_clients: frozenset[bytes]

    @classmethod
    def from_config(cls, config: BatonConfig) -> CurveServerKeys | None:
        """Read from the files the flags name (None without CurveZMQ); ConfigurationError, in
        one line, for a file or folder that does not hold them."""
        if config.zmq_curve_secret_key_file is None:
            return None
        assert config.zmq_curve_allowed_clients is not None  # BatonConfig requires both
        return cls(
            load_key_pair(config.zmq_curve_secret_key_file, "--zmq-curve-secret-key-file"),
            load_allowed_clients(config.zmq_curve_allowed_clients),
        )


def server_as_client(config: BatonConfig) -> CurveClientKeys | None:
    """The keys the server's own client, the HTTP frontend, connects with: the server's pair,
    which it admits (None without CurveZMQ)."""
    keys = CurveServerKeys.from_config(config)
    return None if keys is None else CurveClientKeys(keys.pair.public, keys.pair)


def secure_client_facing(socket: zmq.Socket, context: zmq.Context, config: BatonConfig) -> None:
    """With --zmq-curve-secret-key-file, make `socket` a CurveZMQ server that admits only the
    allowed clients' keys and the server's own; call it before the socket binds, once per
    process (its ZAP handler serves the whole `context`). Nothing without the flag."""
    keys = CurveServerKeys.from_config(config)
    if keys is None:
        return
    # Started before any client can connect: without a ZAP handler, libzmq admits every key.
    # Its running thread holds it, so it serves for the life of the process.
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    admitted = _AllowedKeys(keys.allowed_clients | {keys.pair.public})
    authenticator.configure_curve_callback(domain="*", credentials_provider=admitted)
    socket.curve_server = True
    socket.curve_publickey = keys.pair.public
    socket.curve_secretkey = keys.pair.secret


class _AllowedKeys:
    """The ZAP handler's verdict on a client's key (Z85): admitted if listed."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def _load_certificate(path: str, flag: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigurationError(f"{flag} {path}: no such file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as error:  # unreadable
        raise ConfigurationError(f"{flag} {path}: {error.strerror or error}") from None
    except ValueError:
        raise ConfigurationError(
            f"{flag} {path}: no public-key in it (not a CurveZMQ certificate)"
        ) from None
    _check_key(public, path, flag)
    return public, secret


def _check_key(key: bytes, path: str, flag: str) -> None:
    """A key must be the Z85 text of 32 bytes (libzmq would refuse it only at the socket)."""
    try:
        valid = len(z85.decode(key)) == CURVE_KEY_BYTES
    except (ValueError, KeyError, IndexError):  # z85.decode's for a length or a character
        valid = False
    if not valid:
        raise ConfigurationError(f"{flag} {path}: a key in it is not 40 characters of Z85")
