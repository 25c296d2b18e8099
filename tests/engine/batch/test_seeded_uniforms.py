"""A seeded request's uniforms: torch.rand's numbers from its seed, one at a time or many,
across block boundaries, so every path that samples it reads the same stream."""

from __future__ import annotations

import pytest
import torch

from baton.engine.batch.seeded_uniforms import BLOCK, SeededUniforms, seeded_uniforms, uniforms


def test_the_stream_is_torch_rand_from_the_seed_in_any_grouping() -> None:
    want = torch.rand(3 * BLOCK, generator=torch.Generator().manual_seed(11)).tolist()
    stream = SeededUniforms(11, "cpu")
    got = stream.take(1) + stream.take(BLOCK - 2) + stream.take(BLOCK + 5)
    got += stream.rand((BLOCK - 4,), torch.device("cpu")).tolist()
    assert got == want


def test_a_shaped_draw_and_the_unseeded_source() -> None:
    drawn = uniforms(seeded_uniforms(4, "cpu"), (3, 1), torch.device("cpu"))
    assert drawn.shape == (3, 1) and drawn.dtype == torch.float32
    assert (
        drawn.flatten().tolist()
        == torch.rand(3, generator=torch.Generator().manual_seed(4)).tolist()
    )
    assert seeded_uniforms(None, "cpu") is None
    assert uniforms(None, (2,), torch.device("cpu")).shape == (2,)


def test_uniforms_given_back_are_read_again_and_the_stream_goes_on() -> None:
    want = torch.rand(4 * BLOCK, generator=torch.Generator().manual_seed(5)).tolist()
    stream, position = SeededUniforms(5, "cpu"), 0
    # (take, give back): within a block, back across the boundary just crossed, a whole block.
    for take, back in [(BLOCK - 3, 2), (5, 0), (4, 7), (BLOCK + 6, BLOCK), (2, 0)]:
        assert stream.take(take) == want[position : position + take]
        stream.give_back(back)
        position += take - back
    assert stream.take(3) == want[position : position + 3]
    with pytest.raises(ValueError, match="more than were taken"):
        SeededUniforms(5, "cpu").give_back(1)
