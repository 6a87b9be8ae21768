"""Every tensor name is declared once (triton_vlm.names); each config.pbtxt and the client must agree with it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from triton_vlm import names as N

REPO = Path(__file__).resolve().parents[1] / "model_repository"


def _blocks(text: str, kind: str) -> list[dict]:
    """The `input [...]` / `output [...]` entries of a config.pbtxt."""
    m = re.search(rf"^{kind} \[(.*?)^\]", text, re.S | re.M)
    assert m, f"no {kind} block"
    out = []
    for body in re.findall(r"\{(.*?)\n  \}", m.group(1), re.S):
        name = re.search(r'name:\s*"([^"]+)"', body).group(1)
        dtype = re.search(r"data_type:\s*(\w+)", body).group(1)
        dims = tuple(int(d) for d in re.search(r"dims:\s*\[([^\]]*)\]", body).group(1).split(","))
        out.append({"name": name, "dtype": dtype, "dims": dims, "optional": "optional: true" in body})
    return out


@pytest.mark.parametrize("model", sorted(N.MODELS))
def test_config_matches_declared_tensors(model):
    text = (REPO / model / "config.pbtxt").read_text()
    assert re.search(rf'^name:\s*"{model}"', text, re.M)
    inputs, outputs = N.MODELS[model]
    for kind, specs in (("input", inputs), ("output", outputs)):
        got = _blocks(text, kind)
        assert [g["name"] for g in got] == [s.name for s in specs], f"{model} {kind} names"
        for g, s in zip(got, specs):
            assert g["dtype"] == s.pbtxt_type, f"{model} {s.name} type"
            assert g["dims"] == s.dims, f"{model} {s.name} dims"
            if kind == "input":
                assert g["optional"] == s.pbtxt_optional, f"{model} {s.name} optional"


def test_ensemble_wiring_uses_declared_names():
    text = (REPO / "ensemble" / "config.pbtxt").read_text()
    steps = re.findall(r'model_name:\s*"(\w+)".*?input_map \[(.*?)\].*?output_map \[(.*?)\]', text, re.S)
    assert [s[0] for s in steps] == ["preprocess", "vision", "llm"]
    produced = {s.name for s in N.ENSEMBLE_INPUTS}
    for model, imap, omap in steps:
        ins = dict(re.findall(r'key:\s*"(\w+)"\s*value:\s*"(\w+)"', imap))
        outs = dict(re.findall(r'key:\s*"(\w+)"\s*value:\s*"(\w+)"', omap))
        declared_in = {s.name for s in N.MODELS[model][0]}
        declared_out = {s.name for s in N.MODELS[model][1]}
        assert set(ins) == declared_in - N.NOT_IN_ENSEMBLE, f"{model}: every input wired"
        assert set(outs) <= declared_out
        assert set(ins.values()) <= produced, f"{model} consumes a tensor nobody produced"
        produced |= set(outs.values())
    assert {s.name for s in N.ENSEMBLE_OUTPUTS} <= produced


def test_ensemble_wiring_is_the_one_pipeline_description():
    """Every step input of the ensemble config is what `names.PIPELINE` / `fed_by` say: the internal tensor of the
    nearest earlier step that outputs that name, else the ensemble's own input (the front end follows the same)."""
    text = (REPO / "ensemble" / "config.pbtxt").read_text()
    steps = re.findall(r'model_name:\s*"(\w+)".*?input_map \[(.*?)\]', text, re.S)
    assert tuple(s[0] for s in steps) == N.PIPELINE
    for i, (model, imap) in enumerate(steps):
        ins = dict(re.findall(r'key:\s*"(\w+)"\s*value:\s*"(\w+)"', imap))
        internal = set().union(*(N.fed_by(model, e) for e in N.PIPELINE[:i]))
        assert {k for k, v in ins.items() if v == f"_{k}"} == internal, model
        assert all(v == k for k, v in ins.items() if k not in internal), model
    assert N.fed_by("llm", "preprocess") >= {N.INPUT_IDS, N.MEDIA_GRIDS} and N.IMAGE_EMBEDS in N.fed_by("llm", "vision")


def test_client_protocol_matches():
    from triton_vlm_client import protocol as P

    declared = {s.name: s for s in N.ENSEMBLE_INPUTS + N.ENSEMBLE_OUTPUTS}
    for info in P.INPUTS + P.OUTPUTS:
        assert info.name in declared, f"client uses undeclared tensor {info.name}"
        assert info.dtype == declared[info.name].dtype, info.name
        assert tuple(info.dims) == declared[info.name].dims, info.name
    assert {i.name for i in P.INPUTS} == {s.name for s in N.ENSEMBLE_INPUTS}
    assert (P.EARLY_STOPPING_FALSE, P.EARLY_STOPPING_TRUE, P.EARLY_STOPPING_NEVER) == (
        N.EARLY_STOPPING_FALSE, N.EARLY_STOPPING_TRUE, N.EARLY_STOPPING_NEVER)


def test_no_triton_imports_outside_adapter():
    src = Path(__file__).resolve().parents[1] / "src" / "triton_vlm"
    for f in src.rglob("*.py"):
        if "triton" in f.relative_to(src).parts[:-1]:
            continue
        assert "triton_python_backend_utils" not in f.read_text(), f


def _readme_table(header: str) -> dict[str, list[str]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "interfaces.md").read_text()
    start = text.index(header)
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def _default_text(spec: N.TensorSpec) -> str:
    if not spec.pbtxt_optional or spec.name in N.MODEL_CHECKED:
        return "required"
    if spec.default is None:
        return "none"
    return str(spec.default)


def test_readme_interface_tables_match_declared_tensors():
    """docs/interfaces.md's ensemble tables are the declared tensors: name, type, dims, default and meaning."""
    inputs = _readme_table("| input | type | dims | default | meaning |")
    assert list(inputs) == [s.name for s in N.ENSEMBLE_INPUTS]
    for s in N.ENSEMBLE_INPUTS:
        dtype, dims, default, doc = inputs[s.name]
        assert (dtype, dims) == (s.dtype, str(list(s.dims))), s.name
        assert default == _default_text(s), s.name
        assert doc == s.doc, s.name
    outputs = _readme_table("| output | type | dims | meaning |")
    assert list(outputs) == [s.name for s in N.ENSEMBLE_OUTPUTS]
    for s in N.ENSEMBLE_OUTPUTS:
        assert outputs[s.name] == [s.dtype, str(list(s.dims)), s.doc], s.name
