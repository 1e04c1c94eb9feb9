"""Tensor format goldens: pseudo-gradient sign, equal-weight mean, paths, dtypes."""

from __future__ import annotations

import pytest
import torch

from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import (
    average_deltas,
    check_like,
    compute_pseudo_gradient,
    delta_dtype,
    delta_from_bytes,
    delta_to_bytes,
    is_all_zero,
    load_safetensors,
    open_delta,
    read_metadata,
    save_safetensors,
    state_from_bytes,
    state_to_bytes,
)


def test_pseudo_gradient_golden_sign():
    delta = compute_pseudo_gradient(
        {"w": torch.tensor([3.0, 5.0])}, {"w": torch.tensor([1.0, 4.0])}
    )
    assert delta["w"].tolist() == [2.0, 1.0]
    assert delta["w"].dtype == torch.float32


def test_pseudo_gradient_skips_integer_buffers_and_checks_shapes():
    base = {"w": torch.ones(2), "n": torch.tensor([1])}
    delta = compute_pseudo_gradient(base, {"w": torch.zeros(2), "n": torch.tensor([5])})
    assert set(delta) == {"w"}
    with pytest.raises(ValueError, match=r"w has shape \(3,\), expected \(2,\)"):
        compute_pseudo_gradient(base, {"w": torch.zeros(3), "n": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"missing \['n'\]"):
        compute_pseudo_gradient(base, {"w": torch.zeros(2)})


def test_equal_weight_average_golden():
    mean = average_deltas([{"w": torch.tensor([2.0, 1.0])}, {"w": torch.tensor([0.0, 3.0])}])
    assert mean["w"].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        average_deltas([])
    with pytest.raises(ValueError, match=r"delta 1 does not match delta 0: w has shape \(3,\)"):
        average_deltas([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}])


def test_check_like_names_the_key_and_both_shapes():
    model = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    check_like(model, {"w": (2, 3), "b": torch.ones(3)}, what="unused")  # tensors or shapes
    what = "the global does not match the model"
    with pytest.raises(ValueError, match=rf"^{what}: w has shape \(3, 2\), expected \(2, 3\)$"):
        check_like(model, {"w": (3, 2), "b": (3,)}, what=what)
    with pytest.raises(ValueError, match=rf"^{what}: missing \['b'\], unexpected \['c'\]$"):
        check_like(model, {"w": (2, 3), "c": (3,)}, what=what)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("nodes/a/delta_12.safetensors", ("a", 12)),
        ("nodes/w-1.pod/delta_0.safetensors", ("w-1.pod", 0)),
        ("global/latest.safetensors", None),
        ("nodes//delta_1.safetensors", None),
        ("nodes/a/delta_-1.safetensors", None),
        ("nodes/a/delta_+1.safetensors", None),
        ("nodes/a/delta_01.safetensors", None),
        ("nodes/a/owner.json", None),
        ("nodes/a/b/delta_1.safetensors", None),
    ],
)
def test_parse_delta_path(path, expected):
    assert T.parse_delta_path(path) == expected


@pytest.mark.parametrize(("name", "ratio"), [("fp32", 1.0), ("bf16", 0.5), ("fp16", 0.5)])
def test_delta_dtype_halves_bytes_and_loads_as_float32(name, ratio):
    delta = {"w": torch.randn(64, 64)}
    fp32 = delta_to_bytes(delta, node_id="a", local_step=1, base_outer_step=0)
    data = delta_to_bytes(delta, node_id="a", local_step=1, base_outer_step=0, dtype=name)
    assert len(data) == pytest.approx(len(fp32) * ratio, rel=0.05)
    tensors, meta = delta_from_bytes(data)
    assert tensors["w"].dtype == torch.float32
    assert meta["dtype"] == name and meta["node_id"] == "a" and meta["base_outer_step"] == "0"
    assert torch.allclose(tensors["w"], delta["w"], atol=1e-2 * delta["w"].abs().max().item())
    with pytest.raises(ValueError):
        delta_dtype("fp8")


def test_corrupt_bytes_are_value_errors():
    good = state_to_bytes({"a": torch.ones(2), "b": torch.ones(3)}, metadata={"k": "v"})
    assert state_from_bytes(good)[1] == {"k": "v"}
    header = good[8 : 8 + int.from_bytes(good[:8], "little")]
    overlap = header.replace(b'"data_offsets":[8,20]', b'"data_offsets":[4,16]')
    for data in (
        b"",
        b"not safetensors",
        b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json",
        good[:-4],  # truncated
        good + b"\x00" * 4,  # bytes no tensor owns
        good[:8] + overlap + good[8 + len(header) :],  # two tensors share bytes
    ):
        with pytest.raises(ValueError, match="not a safetensors file"):
            state_from_bytes(data)


def test_a_delta_reader_rejects_keys_shapes_and_non_finite(tmp_path):
    ref = {"w": torch.zeros(2), "step": torch.tensor(3)}
    path = tmp_path / "d.safetensors"

    def check(delta: dict[str, torch.Tensor]) -> None:
        path.write_bytes(delta_to_bytes(delta, node_id="a", local_step=1, base_outer_step=0))
        with open_delta(path) as reader:
            reader.check(ref)

    check({"w": torch.ones(2)})
    for bad, message in (
        ({"w": torch.ones(3)}, r"w has shape \(3,\), expected \(2,\)"),
        ({"x": torch.ones(2)}, r"missing \['w'\], unexpected \['x'\]"),
        ({"w": torch.tensor([1.0, float("nan")])}, "non-finite values in w"),
        ({"w": torch.tensor([1.0, 2e4])}, "beyond the bound"),
    ):
        with pytest.raises(ValueError, match=message):
            check(bad)


def test_all_zero_detection():
    assert is_all_zero({"w": torch.zeros(3)})
    assert not is_all_zero({"w": torch.tensor([0.0, 1e-12])})


def test_tied_weights_round_trip(tmp_path):
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    state = {"emb.weight": emb.weight, "head.weight": head.weight}
    path = save_safetensors(state, tmp_path / "g.safetensors", metadata={"a": 1})
    loaded = load_safetensors(path)
    assert len(loaded) == 2 and torch.equal(loaded["emb.weight"], loaded["head.weight"])
    assert read_metadata(path) == {"a": "1"}
    assert not list(tmp_path.glob(".*tmp*"))
