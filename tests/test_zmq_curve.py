"""CurveZMQ on --zmq-port: a client whose key the server lists is served (encrypted), and the
HTTP API with it, under --api-key; a client without keys, with a key the server does not list,
or with the wrong server key is refused. Bad key files are refused at start-up in one line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth
from helpers import free_port, free_port_pair

from baton import SamplingParams
from baton import launch as launch_module
from baton.client import BatonClient
from baton.config import BatonConfig
from baton.launch import Server
from baton.messages import ClientMessage, Codec, GenerateRequest
from baton.zmq_curve import CurveClientKeys, CurveServerKeys

API_KEY = "curve-test-key"
REFUSED_CONNECT_S = 3.0


class _Keys:
    """Certificates as zmq.auth.create_certificates writes them: the server's pair, an admitted
    client's and a stranger's (each NAME.key and NAME.key_secret), and the allowed folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server_public, self.server_secret = self._create("server")
        self.alice_public, self.alice_secret = self._create("alice")
        self.mallory_public, self.mallory_secret = self._create("mallory")
        self.allowed = root / "allowed"
        self.allowed.mkdir()
        (self.allowed / "alice.key").write_bytes(Path(self.alice_public).read_bytes())

    def _create(self, name: str) -> tuple[str, str]:
        folder = self.root / name
        folder.mkdir()
        public, secret = zmq.auth.create_certificates(str(folder), name)
        return str(public), str(secret)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> _Keys:
    return _Keys(tmp_path_factory.mktemp("curve"))


@pytest.fixture(scope="module")
def server(stories260k_dir: Path, keys: _Keys) -> Iterator[Server]:
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=200,
        port=free_port(),
        zmq_port=free_port_pair(),
        api_key=API_KEY,
        zmq_curve_secret_key_file=keys.server_secret,
        zmq_curve_allowed_clients=str(keys.allowed),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


def _client(server: Server, curve: CurveClientKeys | None) -> BatonClient:
    return BatonClient(server.addresses.requests, server.addresses.replies, curve=curve)


def test_an_admitted_client_and_the_http_api_are_served(server: Server, keys: _Keys) -> None:
    """--zmq-port with --api-key, allowed under CurveZMQ (refused without it): the listed
    client generates over the encrypted sockets, and the HTTP frontend, a client of those
    sockets with the server's own key, answers an authorized request."""
    alice = CurveClientKeys.from_files(keys.server_public, keys.alice_secret)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        async with _client(server, alice) as client:
            return await client.generate("The little dog", params)

    result = asyncio.run(main())
    assert (result.finish_reason, len(result.token_ids)) == ("length", 8)
    url = f"http://{server.config.host}:{server.config.port}/v1/completions"
    body = {"prompt": "The little dog", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == result.text


@pytest.mark.parametrize("who", ["no keys", "an unlisted key", "the wrong server key"])
def test_a_client_the_server_does_not_admit_is_refused(
    server: Server, keys: _Keys, who: str
) -> None:
    """Its handshake is refused, so it never hears the server: it did once, on tcp, with no
    credential at all."""
    curve = {
        "no keys": None,
        "an unlisted key": CurveClientKeys.from_files(keys.server_public, keys.mallory_secret),
        "the wrong server key": CurveClientKeys.from_files(keys.mallory_public, keys.alice_secret),
    }[who]

    async def main():
        client = _client(server, curve)
        try:
            await client.connect(timeout=REFUSED_CONNECT_S)
        finally:
            await client.close()

    with pytest.raises(TimeoutError, match="no answer from"):
        asyncio.run(main())


def test_a_request_from_a_client_without_keys_never_reaches_the_tokenizer(
    server: Server, keys: _Keys
) -> None:
    """The requests socket is CurveZMQ's too: a raw client's request, sent without the
    handshake's keys, is never run."""
    alice = CurveClientKeys.from_files(keys.server_public, keys.alice_secret)

    async def main():
        async with _client(server, alice) as observer:
            before = await observer.stats()
            context = zmq.Context()
            try:
                raw = context.socket(zmq.DEALER)
                raw.connect(server.addresses.requests)
                request = GenerateRequest(request_id="raw", prompt="The little dog")
                raw.send(Codec(ClientMessage).encode(request))
                await asyncio.sleep(1.0)
            finally:
                context.destroy(linger=0)
            return before, await observer.stats()

    before, after = asyncio.run(main())
    assert after.finished_requests == before.finished_requests
    assert after.running_requests == after.waiting_requests == 0


def test_bad_key_files_are_refused_at_start_up_in_one_line(
    keys: _Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Each is refused by `baton launch` before any process starts, naming the flag and the
    file; the flags are checked together and only with --zmq-port."""
    garbled = keys.root / "garbled.key_secret"
    garbled.write_text('curve\n    public-key = "short"\n    secret-key = "short"\n')
    not_a_certificate = keys.root / "empty"
    not_a_certificate.write_text("")
    no_certificates = keys.root / "no-certificates"
    no_certificates.mkdir()
    cases = [
        (keys.root / "missing.key_secret", keys.allowed, "no such file"),
        (keys.server_public, keys.allowed, "no secret-key in it"),
        (garbled, keys.allowed, "not 40 characters of Z85"),
        (not_a_certificate, keys.allowed, "no public-key in it"),
        (keys.server_secret, keys.root / "absent", "not a folder"),
        (keys.server_secret, no_certificates, "no client certificate (*.key)"),
    ]
    base = ["--model", "baton-random", "--port", "1", "--zmq-port", str(free_port_pair())]
    for secret_file, allowed, message in cases:
        caplog.clear()
        flags = ["--zmq-curve-secret-key-file", str(secret_file)]
        flags += ["--zmq-curve-allowed-clients", str(allowed)]
        with caplog.at_level(logging.ERROR):
            assert launch_module.main([*base, *flags]) == 1
        [record] = [r for r in caplog.records if r.levelname == "ERROR"]
        text = record.getMessage()
        assert message in text and "\n" not in text, text
    for flags, message in [
        (["--zmq-curve-secret-key-file", keys.server_secret], "go together"),
        (["--zmq-curve-allowed-clients", str(keys.allowed)], "go together"),
        (
            [
                "--zmq-curve-secret-key-file",
                keys.server_secret,
                "--zmq-curve-allowed-clients",
                str(keys.allowed),
            ],
            "--zmq-port, which is not set",
        ),
    ]:
        with pytest.raises(SystemExit, match=message):
            launch_module.main(["--model", "baton-random", *flags])


def test_the_server_keys_load_from_certificates(keys: _Keys) -> None:
    config = BatonConfig(
        zmq_port=free_port_pair(),
        api_key=API_KEY,
        zmq_curve_secret_key_file=keys.server_secret,
        zmq_curve_allowed_clients=str(keys.allowed),
    )
    loaded = CurveServerKeys.from_config(config)
    assert loaded is not None
    assert loaded.pair == zmq.auth.load_certificate(keys.server_secret)
    assert loaded.allowed_clients == {zmq.auth.load_certificate(keys.alice_public)[0]}
    assert CurveServerKeys.from_config(BatonConfig()) is None
