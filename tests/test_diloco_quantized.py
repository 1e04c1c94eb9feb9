"""Compressed pseudo-gradients (issue 23): int8/int4 blockwise codes on the wire, what the
master refuses, and the node's error feedback.

- The quantizer: every value within half a step of its block's scale, two int4 codes a byte.
- A planted quantized file with a bad scale (NaN, huge, negative), a wrong block count, codes
  out of range, a bad header or another run's header is refused and counted by the master,
  which aggregates the good files of the same round once.
- Error feedback: what was sent plus the final residual is what the node trained, over
  rounds, through a failed upload; resume keeps the residual, a new run drops it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_diloco_master import join, lines, make_master

from speedtronic.config import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.codec import (
    DEFAULT_BLOCK_SIZE,
    QUANTIZED_BITS,
    SCALE_SUFFIX,
    EncodedView,
    decode_value,
    delta_from_bytes,
    delta_to_bytes,
    encode_delta,
    open_delta,
    quantize,
    state_from_bytes,
    state_to_bytes,
    value_slices,
)
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.node import DiLoCoNode, GlobalCandidate, GlobalInbox

QMAX = {"int8": 127, "int4": 7}


def _varied(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude changes by orders of magnitude from block to block, with an
    all-zero stretch (a block of zeros must decode to zeros)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen)
    values *= torch.logspace(-6, 2, numel).flip(0)[torch.randperm(numel, generator=gen)]
    values[: min(numel, 40)] = 0.0
    return values


# -- the quantizer ------------------------------------------------------------------------
@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("block", [8, 128])
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (5,), (), (3, 0)])
def test_round_trip_error_is_at_most_half_a_step_of_each_block(wire, block, shape):
    numel = math.prod(shape)
    tensor = _varied(numel).reshape(shape)
    q = quantize(tensor, QUANTIZED_BITS[wire], block)
    blocks = -(-numel // block)
    assert q.scales.dtype == torch.float32 and tuple(q.scales.shape) == (blocks,)
    if wire == "int8":
        assert q.codes.dtype == torch.int8 and tuple(q.codes.shape) == shape
    else:  # two codes a byte
        assert q.codes.dtype == torch.uint8 and tuple(q.codes.shape) == (-(-numel // 2),)
    decoded = q.dequantize()
    assert decoded.dtype == torch.float32 and tuple(decoded.shape) == shape
    padded = torch.zeros(blocks * block)
    padded[:numel] = tensor.reshape(-1)
    absmax = padded.view(blocks, block).abs().amax(dim=1) if blocks else torch.zeros(0)
    assert torch.equal(q.scales, absmax / QMAX[wire])
    step = q.scales.repeat_interleave(block)[:numel]  # each value's block scale
    error = (decoded.reshape(-1) - tensor.reshape(-1)).abs()
    assert bool((error <= step * 0.5 * (1 + 1e-5) + 1e-30).all())
    assert bool((decoded.reshape(-1)[tensor.reshape(-1) == 0] == 0).all())
    if numel:  # the block's largest value is exact up to float32 rounding of the scale
        top = tensor.reshape(-1).abs().argmax()
        assert decoded.reshape(-1)[top].item() == pytest.approx(tensor.reshape(-1)[top].item())


def test_int4_packs_the_low_nibble_first_and_pads_an_odd_tail_with_code_zero():
    q = quantize(torch.tensor([7.0, -7.0, 1.0]), 4, 8)  # scale 1: codes 7, -7, 1
    assert q.scales.tolist() == [1.0]
    assert q.codes.tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4)]
    assert q.dequantize().tolist() == [7.0, -7.0, 1.0]


def test_quantized_files_are_a_quarter_and_an_eighth_of_fp32_and_decode_as_float32():
    delta = {"a.weight": _varied(65536).reshape(256, 256), "b": _varied(129, seed=1)}
    fp32 = len(delta_to_bytes(delta, node_id="n", local_step=1, base_outer_step=0))
    for wire, ratio in (("int8", (1 + 4 / 128) / 4), ("int4", (0.5 + 4 / 128) / 4)):
        data = delta_to_bytes(
            delta, node_id="n", local_step=1, base_outer_step=0, dtype=wire, block_size=128
        )
        assert len(data) / fp32 == pytest.approx(ratio, rel=0.02)
        tensors, meta = delta_from_bytes(data)
        assert meta["dtype"] == wire and meta["block_size"] == "128"
        for key, value in delta.items():
            expected = quantize(value, QUANTIZED_BITS[wire], 128).dequantize()
            assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], expected)


def test_the_config_default_block_size_is_the_wire_default():
    assert DistributedConfig().delta_block_size == DEFAULT_BLOCK_SIZE
    assert DistributedConfig(delta_dtype="int4").delta_dtype == "int4"


# -- what a reader refuses ----------------------------------------------------------------
REFERENCE = {"w": torch.zeros(300), "n": torch.tensor(3)}  # 3 blocks of 128


def _good(wire: str, values: torch.Tensor | None = None, **extra: str) -> bytes:
    values = torch.linspace(-1.0, 1.0, 300) if values is None else values
    return delta_to_bytes(
        {"w": values},
        node_id="b",
        local_step=5,
        base_outer_step=0,
        dtype=wire,
        block_size=128,
        extra={"instance": "b-1", "final": "false", **extra},
    )


def _tamper(data: bytes, defect: str) -> bytes:
    """``data`` (a good quantized file) with one defect planted."""
    tensors, meta = state_from_bytes(data)
    codes, scales = tensors["w"], tensors["w" + SCALE_SUFFIX]
    if defect == "nan scale":
        scales[1] = float("nan")
    elif defect == "huge scale":  # 2000 x 7 (the largest int4 code) > MAX_DELTA_ABS
        scales[1] = 2000.0
    elif defect == "negative scale":
        scales[1] = -scales[1]
    elif defect == "wrong block count":
        tensors["w" + SCALE_SUFFIX] = scales[:2].clone()
    elif defect == "code out of range":
        if codes.dtype == torch.int8:
            codes[0] = -128
        else:
            codes[0] = codes[0] & 0xF0  # low nibble 0 = code -8
    elif defect == "no block size":
        del meta["block_size"]
    elif defect == "float codes":
        tensors["w"] = torch.zeros(300)
    else:
        raise AssertionError(defect)
    return state_to_bytes(tensors, metadata=meta)


DEFECTS = {
    "nan scale": "non-finite scales in w",
    "huge scale": "beyond the bound",
    "negative scale": "negative scale",
    "wrong block count": "3 float32 block scales expected",
    "code out of range": "code outside",
    "no block size": "needs a block_size",
    "float codes": "expected",
}


@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_reader_refuses_each_planted_defect_and_accepts_the_good_file(tmp_path, wire, defect):
    good = tmp_path / "good.safetensors"
    good.write_bytes(_good(wire))
    with open_delta(good) as reader:
        reader.check(REFERENCE)
        total = {"w": torch.zeros(300)}
        reader.add_to(total)
    expected = quantize(torch.linspace(-1.0, 1.0, 300), QUANTIZED_BITS[wire], 128)
    assert torch.equal(total["w"], expected.dequantize())
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_tamper(_good(wire), defect))
    with pytest.raises(ValueError, match=DEFECTS[defect]), open_delta(bad) as reader:
        reader.check(REFERENCE)
    with pytest.raises(ValueError, match=DEFECTS[defect]):
        delta_from_bytes(bad.read_bytes())


def test_a_reader_refuses_a_quantized_file_of_another_shape_or_with_extra_keys(tmp_path):
    path = tmp_path / "d.safetensors"
    for wire, count in (("int8", 299), ("int4", 310)):  # int4: the shapes its header lists
        path.write_bytes(_good(wire, torch.ones(count)))
        shape = rf"w has shape \({count},\), expected \(300,\)"
        with pytest.raises(ValueError, match=shape), open_delta(path) as reader:
            reader.check(REFERENCE)
    tensors, meta = state_from_bytes(_good("int4", torch.ones(310)))
    meta["shapes"] = json.dumps({"w": [300]})  # the header agrees with the model, not the codes
    path.write_bytes(state_to_bytes(tensors, metadata=meta))
    with (
        pytest.raises(ValueError, match=r"int4 codes of shape \(150,\)"),
        open_delta(path) as reader,
    ):
        reader.check(REFERENCE)
    tensors, meta = state_from_bytes(_good("int8"))
    tensors["x" + SCALE_SUFFIX] = torch.ones(1)
    path.write_bytes(state_to_bytes(tensors, metadata=meta))
    with pytest.raises(ValueError, match=r"do not pair.*x::scale"), open_delta(path) as r:
        r.check(REFERENCE)


# -- what the master refuses and counts -----------------------------------------------------
def _plant(t, node: str, round: int, data: bytes) -> None:
    owner = {"instance": f"{node}-1", "state": "training"}
    t.commit(
        {
            f"nodes/{node}/delta_{round}.safetensors": data,
            f"nodes/{node}/owner.json": json.dumps(owner).encode(),
        }
    )


def _send(t, node: str, round: int, wire: str, values: torch.Tensor, **extra: str) -> None:
    meta = t.global_metadata()
    data = delta_to_bytes(
        {"w": values},
        node_id=node,
        round_index=round,
        local_step=5 * (round + 1),
        base_outer_step=round,
        dtype=wire,
        block_size=128,
        extra={"instance": f"{node}-1", "final": "false", "run_id": meta.run_id, **extra},
    )
    _plant(t, node, round, data)


def _decoded(wire: str, values: torch.Tensor) -> torch.Tensor:
    return quantize(values, QUANTIZED_BITS[wire], 128).dequantize()


@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("defect", [*sorted(DEFECTS), "another run"])
def test_the_master_refuses_and_counts_a_planted_file_and_aggregates_the_rest_once(
    tmp_path, caplog, wire, defect
):
    master, t, log = make_master(tmp_path, state={"w": torch.zeros(300), "n": torch.tensor(3)})
    join(t, "a")
    join(t, "b")
    master.poll_once()  # bootstrap
    a0, b0 = torch.linspace(-1, 1, 300), torch.linspace(2, -2, 300)
    _send(t, "a", 0, wire, a0)
    _send(t, "b", 0, wire, b0)
    assert master.poll_once() is True  # round 0: both quantized files, decoded in float32
    expected = -(_decoded(wire, a0) + _decoded(wire, b0)) / 2
    assert torch.equal(t.read_global()["w"], expected)
    # round 1: a's file is good, b's is planted with the defect
    a1 = torch.linspace(0.5, -0.25, 300)
    _send(t, "a", 1, wire, a1)
    b1 = torch.full((300,), 3.0)
    if defect == "another run":
        _send(t, "b", 1, wire, b1, run_id="0123456789abcdef")
    else:
        meta = t.global_metadata()
        good = delta_to_bytes(
            {"w": b1},
            node_id="b",
            round_index=1,
            local_step=10,
            base_outer_step=1,
            dtype=wire,
            block_size=128,
            extra={"instance": "b-1", "final": "false", "run_id": meta.run_id},
        )
        _plant(t, "b", 1, _tamper(good, defect))
    assert master.poll_once() is True  # b's file is refused; the round closes with a alone
    row = log.of("outer_step")[-1]
    assert row["included"] == ["a/1"]
    counted = "deltas_stale" if defect == "another run" else "deltas_corrupt"
    assert row[counted] == 1, row
    assert torch.equal(t.read_global()["w"], expected - _decoded(wire, a1))
    assert "nodes/b/delta_1.safetensors" not in t.list_files()  # pruned, never read again
    if defect != "another run":
        warned = [m for level, m in lines(caplog) if level == "warning"]
        assert any("nodes/b/delta_1" in m and DEFECTS[defect] in m for m in warned), warned
    # nothing twice: a replay of b's aggregated round 0 is skipped, and a good round-1 file
    # from b afterwards is folded (late) into round 2 once, beside its round-2 file
    _send(t, "b", 0, wire, b0)
    _send(t, "b", 1, wire, torch.full((300,), 0.5))
    _send(t, "b", 2, wire, torch.full((300,), 0.25))
    _send(t, "a", 2, wire, -a1)  # (the same values as a's last file would be refused)
    assert master.poll_once() is True
    row = log.of("outer_step")[-1]
    assert row["included"] == ["a/2", "b/1", "b/2"] and row["deltas_skipped"] == 1, row
    included = [item for r in log.of("outer_step") for item in r["included"]]
    assert len(included) == len(set(included))


# -- error feedback in the node -------------------------------------------------------------
class Sent:
    """A ``send`` that records what the master would add (the decoded wire) and the whole
    contribution as it was sent (once the upload arrived, the node reuses the contribution's
    buffers for its residual), and can fail."""

    def __init__(self):
        self.decoded: list[dict[str, torch.Tensor]] = []
        self.contributions: list[dict[str, torch.Tensor]] = []
        self.jobs = []
        self.fail_rounds: set[int] = set()
        self.failed = 0

    def __call__(self, job):
        if job.round in self.fail_rounds:
            self.fail_rounds.discard(job.round)
            self.failed += 1
            raise ConnectionError("exchange down")
        self.jobs.append(job)
        self.contributions.append({k: v.clone() for k, v in job.delta.items()})
        wire = job.wire if job.wire is not None else job.delta
        self.decoded.append({k: decode_value(v) for k, v in wire.items()})
        return 1


def make_node(wire="int4", *, error_feedback=True, model=None):
    settings = DistributedConfig(
        inner_steps=2,
        sync="overlapped",
        round_timeout=0.2,
        async_delta_upload=False,
        delta_dtype=wire,
        delta_block_size=8,
        error_feedback=error_feedback,
    )
    if model is None:
        model = torch.nn.Linear(16, 4, bias=False)
        torch.nn.init.normal_(model.weight, std=0.1)
    sent = Sent()
    inbox = GlobalInbox(None, interval=0.01, threaded=False)
    node = DiLoCoNode(RoundSettings.of(settings), model, send=sent, inbox=inbox)
    return node, sent, model


def _steps(node, model, count, seed):
    """``count`` inner steps, each moving the weights by varied amounts."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        with torch.no_grad():
            scale = torch.logspace(-5, 0, model.weight.numel()).reshape(model.weight.shape)
            model.weight.add_(torch.randn(model.weight.shape, generator=gen) * scale)
        node.after_optimizer_step()


def _total(sent: Sent) -> torch.Tensor:
    return torch.stack([d["weight"] for d in sent.decoded]).sum(dim=0)


@pytest.mark.parametrize("wire", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("fail_rounds", [set(), {1, 2}])
def test_what_was_sent_plus_the_residual_is_what_the_node_trained(wire, fail_rounds):
    node, sent, model = make_node(wire)
    start = model.weight.detach().clone()
    sent.fail_rounds = set(fail_rounds)
    _steps(node, model, 14, seed=3)  # 7 contributions
    assert sent.failed == len(fail_rounds)
    trained = start - model.weight.detach()  # the sum of the true contributions
    residual = node.progress.residual["weight"]
    assert node.progress.carry is None
    assert torch.allclose(_total(sent) + residual, trained, rtol=0, atol=1e-6)
    # the wire is lossy: without the residual the sum is off by more than rounding
    assert (_total(sent) - trained).abs().max().item() > 1e-5
    # each contribution that arrived carried its predecessor's residual
    assert [j.round for j in sent.jobs] == list(range(7 - len(fail_rounds)))


def test_a_failed_upload_carries_the_whole_contribution_and_drops_the_residual():
    node, sent, model = make_node("int4")
    _steps(node, model, 2, seed=1)  # round 0 arrives; a residual is kept
    kept = node.progress.residual["weight"].clone()
    assert kept.abs().max().item() > 0
    sent.fail_rounds = {1}
    before = model.weight.detach().clone()
    _steps(node, model, 2, seed=2)  # round 1 fails
    assert node.progress.residual is None  # it is inside the carry now, never counted twice
    progress = node.progress.carry["weight"] - kept
    assert torch.allclose(progress, before - model.weight.detach(), atol=1e-6)


def test_without_error_feedback_the_residual_is_lost():
    node, sent, model = make_node("int4", error_feedback=False)
    start = model.weight.detach().clone()
    _steps(node, model, 14, seed=3)
    assert node.progress.residual is None
    trained = start - model.weight.detach()
    assert (_total(sent) - trained).abs().max().item() > 1e-3


def test_fp32_keeps_no_residual_and_sends_the_contribution_exactly():
    node, sent, model = make_node("fp32")
    start = model.weight.detach().clone()
    _steps(node, model, 6, seed=4)
    assert node.progress.residual is None and all(j.wire is None for j in sent.jobs)
    assert torch.allclose(_total(sent), start - model.weight.detach(), atol=1e-6)


def test_resume_keeps_the_residual_and_the_next_contribution_adds_it():
    node, sent, model = make_node("int8")
    _steps(node, model, 4, seed=5)
    state = node.state_dict()
    assert torch.equal(state["residual"]["weight"], node.progress.residual["weight"])
    copy = torch.nn.Linear(16, 4, bias=False)
    copy.load_state_dict(model.state_dict())
    resumed, resent, _ = make_node("int8", model=copy)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.progress.residual["weight"], node.progress.residual["weight"])
    anchor = resumed.progress.anchor["weight"].clone()
    residual = resumed.progress.residual["weight"].clone()
    _steps(resumed, copy, 2, seed=6)
    sent_delta = resent.contributions[-1]["weight"]
    assert torch.allclose(sent_delta, anchor - copy.weight.detach() + residual)
    # the same steps on the original node send the same codes
    _steps(node, model, 2, seed=6)
    assert torch.equal(sent.decoded[-1]["weight"], resent.decoded[-1]["weight"])


def test_a_new_run_resets_the_residual():
    node, sent, model = make_node("int4")
    node.merge(GlobalCandidate(0, {"weight": model.weight.detach().clone()}, run_id="run-1"))
    _steps(node, model, 2, seed=7)
    assert node.progress.residual is not None
    fresh = torch.zeros_like(model.weight)
    node.merge(GlobalCandidate(0, {"weight": fresh}, run_id="run-2"))
    assert node.progress.residual is None and node.state_dict()["residual"] is None
    _steps(node, model, 2, seed=8)
    assert sent.jobs[-1].run_id == "run-2" and sent.jobs[-1].round == 0


# -- memory: the node's buffers are reused, the quantizer works a slice at a time -----------
def test_the_residual_lives_in_the_contribution_buffers_and_a_checkpoint_skips_the_sent_job():
    node, sent, model = make_node("int8")
    anchor = node.progress.anchor["weight"].data_ptr()
    _steps(node, model, 2, seed=9)  # one contribution, uploaded
    job = sent.jobs[-1]
    # the old anchor's buffers became the contribution, whose buffers became the residual
    assert job.delta["weight"].data_ptr() == anchor
    assert node.progress.residual["weight"].data_ptr() == anchor and job.arrived
    node.uploads.pending = job  # a checkpoint taken before the uploader let the job go
    state = node.state_dict()
    assert state["pending"] is None  # it arrived: resuming must not send the residual
    assert torch.equal(state["residual"]["weight"], node.progress.residual["weight"])


def test_the_merge_installs_in_place_into_the_anchor():
    node, _, model = make_node("fp32")
    before = node.progress.anchor["weight"].data_ptr()
    node.merge(GlobalCandidate(0, {"weight": torch.full_like(model.weight, 0.5)}))
    assert node.progress.anchor["weight"].data_ptr() == before
    assert torch.equal(node.progress.anchor["weight"], torch.full_like(model.weight, 0.5))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 9, 128])
def test_the_quantizer_in_slices_gives_the_codes_of_the_whole_tensor(monkeypatch, bits, block):
    gen = torch.Generator().manual_seed(block)
    tensor = torch.randn(3001, generator=gen) * torch.logspace(-6, 1, 3001)
    monkeypatch.setattr(codec, "SLICE", 1 << 30)  # one slice: the whole tensor
    whole = quantize(tensor, bits, block)
    values = whole.dequantize()
    monkeypatch.setattr(codec, "SLICE", 100)  # slices of a few blocks
    assert len(list(value_slices(3001, block))) > 10
    sliced = quantize(tensor, bits, block)
    assert torch.equal(sliced.codes, whole.codes) and torch.equal(sliced.scales, whole.scales)
    assert torch.equal(sliced.dequantize(), values)
    view = EncodedView({"t": tensor.clone()}, f"int{bits}", block)
    assert torch.equal(view.keep_residual()["t"], tensor - values)


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4"])
def test_a_delta_file_is_encoded_as_it_is_written(wire):
    gen = torch.Generator().manual_seed(1)
    delta = {"a": torch.randn(40, 9, generator=gen), "b": torch.randn(7, generator=gen)}
    header = dict(node_id="n", local_step=3, base_outer_step=1, dtype=wire, block_size=16)
    encoded = encode_delta(delta, wire, 16)  # the whole encoded copy, as before
    data = delta_to_bytes(encoded, **header)
    assert delta_to_bytes(delta, **header) == data
    assert delta_to_bytes(EncodedView(delta, wire, 16), **header) == data
    decoded, _ = delta_from_bytes(data)
    assert all(torch.equal(decoded[k], decode_value(encoded[k])) for k in delta)
