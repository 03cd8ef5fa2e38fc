"""ComfyUI's own code accepts the single files bench/expert_files.py and tests/support/single_files.py write, in this
set's ComfyUI.

Each check group runs ComfyUI in a subprocess (this file run as a script, cwd = the ComfyUI tree,
`--cpu`), so ComfyUI's globals never reach pytest:

- experts: `comfy.sd.load_diffusion_model` (what core UNETLoader calls) for every expert layout; the
  T2V base + Kijai VACE module merged the way KJNodes' DiffusionModelLoaderKJ merges them
  (`sd.update(vace_sd)`, then `load_diffusion_model_state_dict`); GGUF experts dequantised with gguf-py
  and loaded through `load_diffusion_model_state_dict`; and our original key names against
  `comfy.ldm.wan.model.VaceWanModel` built on meta.
- vae: core VAELoader's path (`load_torch_file`, `comfy.sd.VAE(sd=...)`), keys against ComfyUI's WanVAE,
  and a decode compared with diffusers'.
- text_encoder: `comfy.sd.load_clip(type=wan)` with ComfyUI's own umt5 classes, sized to the tiny
  encoder through `model_options["umt5xxl_model_config"]`; its prompt embedding compared with transformers'.

Where 0.3.75 and 0.33 differ, each case says what each version does (see `_expected_problems`).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# Run as a script (the ComfyUI side), this file needs the repository on the path for its helpers.
_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench import expert_files as ef  # noqa: E402
from tests.support import single_files as sf  # noqa: E402

pytestmark = pytest.mark.integration

PROMPT = "a cat walks on the grass in the morning light"
FP8 = torch.float8_e4m3fn


# ==================================================================================================
# Parent side (pytest)


def _start_group(comfy_dir: Path, group: str, job: dict, work: Path) -> tuple[subprocess.Popen, Path]:
    """Starts one check group's subprocess (output to `<group>.log`); `_finish_group` collects it."""
    job_path, out = work / f"{group}.job.json", work / f"{group}.json"
    job_path.write_text(json.dumps(job))
    with open(work / f"{group}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), group, str(comfy_dir), str(job_path), str(out)],
            cwd=str(comfy_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, out


def _finish_group(started: tuple[subprocess.Popen, Path]) -> dict:
    proc, out = started
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = out.with_suffix(".log").read_text()
    assert proc.returncode == 0 and out.is_file(), f"{out.stem} check failed:\n{log[-8000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def comfy_dir() -> Path:
    """This set's ComfyUI tree (scripts/comfy_server.py finds it), or the set's skip."""
    from tests.support.comfyui import require_comfyui

    return require_comfyui("comfy/sd.py")


@pytest.fixture(scope="module")
def components(comfy_dir, comfy_components_default):
    """The session's COMFY_SHAPED components (tests/conftest.py); only read here."""
    return comfy_components_default


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("comfy_accepts")


@pytest.fixture(scope="module")
def started(comfy_dir, components, work):
    """The three check groups, run at once (each child is single-threaded)."""
    jobs = {"experts": _experts_job(components, work), "vae": _vae_job(components, work)}
    jobs["text_encoder"] = _text_encoder_job(components, work)
    groups = {group: _start_group(comfy_dir, group, job, work) for group, job in jobs.items()}
    yield groups
    for proc, _ in groups.values():  # a group no selected test waited for
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Expert cases: name -> `write_expert` kwargs per file ("expert": which component, default the high-noise
# `transformer`; "drop": keys left out; "gguf": a GGUF of that type). Two files: base + VACE module, merged.
EXPERT_CASES = {
    "bf16": [{}],
    "bf16-low": [{"expert": "transformer_2"}],
    "bf16-prefixed": [{"prefix": ef.PREFIX}],
    "fp16": [{"dtype": "float16"}],
    "fp16-prefixed": [{"dtype": "float16", "prefix": ef.PREFIX}],
    "scaled_fp8": [{"quant": "scaled_fp8"}],
    "scaled_fp8-prefixed": [{"quant": "scaled_fp8", "prefix": ef.PREFIX}],
    "scaled_fp8-fp32-marker": [{"quant": "scaled_fp8", "marker": "float32"}],
    "scaled_fp8-blocks-only": [{"quant": "scaled_fp8", "fp8_layers": "blocks", "scale_input": False}],
    # Negative control: without the marker ComfyUI does not know the scales (diffusers' single-file
    # loader behaves the same way on real fp8_scaled files).
    "scaled_fp8-no-marker": [{"quant": "scaled_fp8", "drop": ["scaled_fp8"]}],
    "mixed_fp8": [{"quant": "mixed_fp8"}],
    "mixed_fp8-prefixed": [{"quant": "mixed_fp8", "prefix": ef.PREFIX}],
    "mixed_fp8-header": [{"quant": "mixed_fp8", "mixed_form": "header"}],
    "mixed_fp8-tensors": [{"quant": "mixed_fp8", "mixed_form": "tensors"}],
    "t2v-base-alone": [{"dtype": "float16", "parts": "base"}],
    "t2v-base+vace-module": [{"dtype": "float16", "parts": "base"}, {"parts": "vace"}],
    "t2v-base+vace-module-prefixed": [{"dtype": "float16", "parts": "base", "prefix": ef.PREFIX}, {"parts": "vace"}],
    "gguf-Q8_0": [{"gguf": "Q8_0"}],
    "gguf-Q6_K": [{"gguf": "Q6_K"}],
}


def _write_case(work: Path, components: dict, name: str, spec: list[dict]) -> list[str]:
    paths = []
    for i, kwargs in enumerate(spec):
        kwargs = dict(kwargs)
        transformer = components[kwargs.pop("expert", "transformer")]
        if "gguf" in kwargs:
            paths.append(str(ef.write_gguf_expert(work / f"{name}.gguf", transformer, kwargs["gguf"])))
            continue
        for key in ("dtype", "marker"):
            if key in kwargs:
                kwargs[key] = getattr(torch, kwargs[key])
        path = work / f"{name}-{i}.safetensors"
        if "drop" in kwargs:
            drop = kwargs.pop("drop")
            state, metadata = ef.expert_state_dict(transformer, **kwargs)
            save_file({k: v for k, v in state.items() if k not in drop}, str(path), metadata=metadata or None)
        else:
            ef.write_expert(path, transformer, **kwargs)
        paths.append(str(path))
    return paths


def _expected_problems(name: str, current_scheme: bool, keys: dict) -> dict:
    """What ComfyUI logs for a case: {"missing": set, "unexpected": set}. `current_scheme`: this
    ComfyUI has `comfy.utils.convert_old_quants` (0.33; not 0.3.75), which turns legacy scaled fp8
    and the `_quantization_metadata` header into per-layer `.comfy_quant` tensors and reads those."""
    if name == "scaled_fp8-no-marker":
        return {"missing": set(), "unexpected": set(keys["scale_weight"])}
    none = {"missing": set(), "unexpected": set()}
    if current_scheme:
        return none
    # 0.3.75 reads mixed precision only from the `_quantization_metadata` header: the `.comfy_quant`
    # tensors that 0.33 writes and reads are left over ...
    if name in ("mixed_fp8", "mixed_fp8-prefixed"):
        return {"missing": set(), "unexpected": set(keys["comfy_quant"])}
    # ... and a file with only those tensors is no mixed-precision file to it at all (its
    # `weight_scale`s are left over, its fp8 weights are used unscaled).
    if name == "mixed_fp8-tensors":
        return {"missing": set(), "unexpected": set(keys["comfy_quant"]) | set(keys["weight_scale"])}
    # 0.3.75's scaled-fp8 ops give every Linear a `scale_weight` and a `scale_input`, so a file that
    # quantises only the blocks' Linears, without `scale_input`, misses the others (they default to 1).
    if name == "scaled_fp8-blocks-only":
        return {"missing": set(keys["all_linear_scales"]) - set(keys["scale_weight"]), "unexpected": set()}
    return none


def _experts_job(components: dict, work: Path) -> dict:
    with ef.single_thread():
        cases = {name: _write_case(work, components, name, spec) for name, spec in EXPERT_CASES.items()}
    for expert in ("transformer", "transformer_2"):  # the fp32 source, for the dequantised weights
        state = ef.original_wan_state_dict(components[expert])
        save_file(
            {k: v.detach().float().contiguous() for k, v in state.items()},
            str(work / f"reference-{expert}.safetensors"),
        )
    config = dict(components["transformer"].config)
    job = {
        "cases": cases,
        "reference": {
            name: str(work / f"reference-{'transformer_2' if name == 'bf16-low' else 'transformer'}.safetensors")
            for name in cases
        },
        "model": {
            "dim": config["num_attention_heads"] * config["attention_head_dim"],
            "num_heads": config["num_attention_heads"],
            "ffn_dim": config["ffn_dim"],
            "num_layers": config["num_layers"],
            "vace_layers": len(config["vace_layers"]),
            "vace_in_dim": config["vace_in_channels"],
            "in_dim": config["in_channels"],
            "text_dim": config["text_dim"],
        },
    }
    return job


@pytest.fixture(scope="module")
def expert_results(started) -> dict:
    results = _finish_group(started["experts"])
    results["paths"] = json.loads(Path(started["experts"][1].with_suffix(".job.json")).read_text())["cases"]
    return results


def test_original_wan_keys_are_comfys_vace_model_keys(expert_results):
    assert expert_results["keys"]["only_ours"] == [] and expert_results["keys"]["only_comfy"] == []
    assert expert_results["keys"]["shape_mismatch"] == []


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_gguf_expert_is_comfys_key_set_under_city96s_conventions(expert_results, qtype):
    """gguf-py reads the file; city96's conventions reversed (ggml shapes reversed back, no prefix)
    give exactly ComfyUI's VaceWanModel keys and shapes, with city96's tensor types."""
    import gguf

    types = gguf.GGMLQuantizationType
    (path,) = expert_results["paths"][f"gguf-{qtype}"]
    reader = gguf.GGUFReader(path)
    field = reader.get_field("general.architecture")
    assert bytes(field.parts[field.data[-1]]).decode() == "wan"
    shapes = {t.name: tuple(int(v) for v in reversed(t.shape)) for t in reader.tensors}
    comfy_shapes = {k: tuple(v) for k, v in expert_results["keys"]["comfy_shapes"].items()}
    assert shapes == comfy_shapes
    kept = ("text_embedding.", "time_embedding.", "time_projection.", "head.head.")
    for tensor in reader.tensors:
        name, shape = tensor.name, shapes[tensor.name]
        if len(shape) in (1, 5) or name.endswith("modulation"):
            expected = types.F32
        elif name.startswith(kept):
            expected = types.BF16
        elif qtype == "Q6_K" and shape[-1] % 256:
            expected = types.F16
        else:
            expected = getattr(types, qtype)
        assert tensor.tensor_type == expected, (name, tensor.tensor_type.name)


@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_comfy_loads_the_expert(expert_results, name):
    result = expert_results["cases"][name]
    assert result["error"] is None, result["error"]
    model = expert_results["model"]
    config = result["unet_config"]
    vace = name != "t2v-base-alone"
    assert result["model_class"] == ("WAN21_Vace" if vace else "WAN21")
    assert result["diffusion_model_class"] == ("VaceWanModel" if vace else "WanModel")
    assert config["image_model"] == "wan2.1" and config["model_type"] == ("vace" if vace else "t2v")
    for key in ("dim", "num_heads", "ffn_dim", "num_layers", "in_dim"):
        assert config[key] == model[key], key
    if vace:
        assert config["vace_layers"] == model["vace_layers"] and config["vace_in_dim"] == model["vace_in_dim"]
    current_scheme = expert_results["current_scheme"]
    expected = _expected_problems(name, current_scheme, result["keys"])
    assert set(result["missing"]) == expected["missing"]
    assert set(result["unexpected"]) == expected["unexpected"]
    assert result["left_over"] == []
    # What ComfyUI holds is the file's data (cast to its storage dtype), scales included ...
    assert result["storage_mismatch"] == [], result["storage_mismatch"][:5]
    assert result["not_loaded"] == [], result["not_loaded"][:5]
    # ... and its dequantised weights are the source's, within the format's rounding; the
    # exceptions are the marker-less file and, in 0.3.75, a tensors-only mixed file, whose scales
    # ComfyUI never reads.
    if name == "scaled_fp8-no-marker" or (not current_scheme and name == "mixed_fp8-tensors"):
        assert result["off_tolerance"], "ComfyUI applied scales it is not expected to read"
    else:
        assert result["off_tolerance"] == [], result["off_tolerance"][:5]
    assert result["checked"] > 100


# --------------------------------------------------------------------------------------------------
# VAE


def _vae_job(components: dict, work: Path) -> dict:
    vae = components["vae"]
    path = sf.write_vae(work / "wan_2.1_vae.safetensors", vae)
    # diffusers' decode with the weights as written (bf16), the reference for ComfyUI's decode.
    latent = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ef.single_thread():
        reference = type(vae).from_config(vae.config).eval()
        reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in vae.state_dict().items()})
        video = reference.decode(latent).sample  # (1, 3, 5, 32, 32) in [-1, 1]
    save_file({"latent": latent, "video": video.contiguous()}, str(work / "vae_reference.safetensors"))
    job = {"path": str(path), "reference": str(work / "vae_reference.safetensors"), "base_dim": vae.config.base_dim}
    return job


@pytest.fixture(scope="module")
def vae_result(started) -> dict:
    return _finish_group(started["vae"])


def test_comfy_loads_the_vae_as_wan21(vae_result):
    assert vae_result["error"] is None, vae_result["error"]
    assert vae_result["class"] == "comfy.ldm.wan.vae.WanVAE"
    assert vae_result["latent_channels"] == 16 and vae_result["latent_dim"] == 3
    assert vae_result["missing"] == [] and vae_result["unexpected"] == []
    assert vae_result["only_ours"] == [] and vae_result["only_comfy"] == [] and vae_result["shape_mismatch"] == []
    assert vae_result["storage_mismatch"] == []


def test_comfy_decodes_like_diffusers(vae_result):
    assert vae_result["decode_shape"] == [1, 5, 32, 32, 3]
    assert vae_result["decode_max_error"] < 1e-4


# --------------------------------------------------------------------------------------------------
# umt5


def _text_encoder_job(components: dict, work: Path) -> dict:
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    encoder = components["text_encoder"]
    spiece = sentencepiece_model_bytes()
    files = {
        "fp16": sf.write_umt5(work / "umt5_xxl_fp16.safetensors", encoder, spiece, dtype=torch.float16),
        "bf16": sf.write_umt5(work / "umt5_xxl_bf16.safetensors", encoder, spiece, dtype=torch.bfloat16),
        "fp8_scaled": sf.write_umt5(
            work / "umt5_xxl_fp8_e4m3fn_scaled.safetensors", encoder, spiece, dtype=torch.float16, quant="scaled_fp8"
        ),
    }
    c = encoder.config
    job = {
        "files": {k: str(v) for k, v in files.items()},
        "config": {
            "num_layers": c.num_layers,
            "d_model": c.d_model,
            "d_kv": c.d_kv,
            "num_heads": c.num_heads,
            "d_ff": c.d_ff,
            "vocab_size": c.vocab_size,
        },
        "prompt": PROMPT,
        "out_dir": str(work),
    }
    return job


@pytest.fixture(scope="module")
def text_encoder_results(started, components) -> dict:
    results = _finish_group(started["text_encoder"])
    encoder = components["text_encoder"]
    # transformers' encoder on ComfyUI's token ids, the reference for ComfyUI's embedding.
    for result in results["files"].values():
        if result["error"] is not None:
            continue
        out = load_file(result["embedding"])
        ids = out["ids"].long()[None]
        with torch.no_grad(), ef.single_thread():
            reference = encoder(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        cond = out["cond"][: ids.shape[1]].float()
        result["embedding_error"] = float(((cond - reference).abs().max() / reference.abs().max()).item())
        result["padding_max"] = float(out["cond"][ids.shape[1] :].abs().max().item())
    return results


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_scaled"])
def test_comfy_loads_the_umt5_file(text_encoder_results, name):
    result = text_encoder_results["files"][name]
    assert result["error"] is None, result["error"]
    assert result["te_class"].endswith("WanTEModel") and result["t5_class"] == "comfy.text_encoders.t5.T5"
    assert result["missing"] == []
    # ComfyUI loads the sentencepiece model from `spiece_model` as its tokenizer (debug log "clip unexpected").
    assert result["unexpected"] == ["spiece_model"]
    assert result["only_file"] == [] and result["only_comfy"] == [] and result["shape_mismatch"] == []
    assert result["storage_mismatch"] == []
    assert result["tokenizer_ids"] == result["spiece_ids"] + [1]  # + </s>
    tolerance = {"fp16": 2e-3, "bf16": 2e-2, "fp8_scaled": 1.5e-1}[name]
    assert result["embedding_error"] < tolerance
    assert result["padding_max"] == 0.0  # ComfyUI zeroes the masked positions


# ==================================================================================================
# Child side (a subprocess inside the ComfyUI tree)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a foreign record with bad args
            pass

    def lists(self, prefix: str) -> list[str]:
        """The key lists of messages like "unet missing: [...]"."""
        found = []
        for message in self.messages:
            if message.startswith(prefix):
                text = message[len(prefix) :].strip().lstrip(":").strip()
                text = text.removeprefix("dict_keys(").removesuffix(")").rstrip(":")
                found.extend(ast.literal_eval(text))
        return found


def _import_comfy(comfy_dir: str) -> _Records:
    os.chdir(comfy_dir)
    sys.path.insert(0, comfy_dir)
    sys.argv = ["main.py", "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.cli_args

    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds contention
    records = _Records()
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    root.addHandler(records)
    import comfy.sd

    return records


def _strip(key: str) -> str:
    return key.removeprefix(ef.PREFIX)


def _file_tensors(paths: list[str]) -> dict:
    """The case's files' tensors, merged like KJNodes (`sd.update(vace_sd)`), prefix stripped."""
    tensors = {}
    for path in paths:
        tensors.update({_strip(k): v for k, v in load_file(path).items()})
    return tensors


def _module_params(module) -> dict:
    """Every parameter of a ComfyUI model by name, without calling its (quantised) state_dict()."""
    params = {}
    for prefix, sub in module.named_modules():
        for name, param in sub._parameters.items():
            if param is not None:
                params[f"{prefix}.{name}" if prefix else name] = (sub, name, param)
    return params


def _storage(param):
    """(stored tensor, scale or None) of a ComfyUI parameter: a QuantizedTensor's fp8 data and scale."""
    qdata = getattr(param, "_qdata", None)
    if qdata is None:
        return param.data, None
    params = getattr(param, "_params", None)
    scale = params.scale if params is not None else param._layout_params["scale"]
    return qdata, scale


def _effective(sub, name, param) -> torch.Tensor:
    """The weight ComfyUI computes with: QuantizedTensor.dequantize(), or 0.3.75's scaled-fp8
    `weight * scale_weight`."""
    if hasattr(param, "dequantize") and getattr(param, "_qdata", None) is not None:
        return param.dequantize().float()
    scale = getattr(sub, "scale_weight", None)
    if name == "weight" and scale is not None and param.dtype == FP8:
        return param.data.float() * scale.float()
    return param.data.float()


_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, FP8: 2.0**-4}


def _compare_weights(params: dict, file_tensors: dict, reference: dict) -> dict:
    """Storage equal to the file (cast to ComfyUI's dtype), effective weight near the fp32 source."""
    storage_mismatch, off_tolerance, checked = [], [], 0
    for key, (sub, name, param) in params.items():
        if key not in file_tensors:
            continue
        checked += 1
        stored, scale = _storage(param)
        data = file_tensors[key]
        if name in ("scale_weight", "scale_input"):
            if not torch.equal(stored.float(), data.float()):
                storage_mismatch.append(key)
            continue
        if stored.dtype == FP8 and data.dtype != FP8:
            same = torch.equal(stored.float(), data.to(FP8).float())  # 0.3.75 casts Linear tensors to fp8
        else:
            same = torch.equal(stored.float(), data.to(stored.dtype).float())
        if scale is not None:
            layer = key[: -len(".weight")]
            file_scale = file_tensors.get(f"{layer}.weight_scale", file_tensors.get(f"{layer}.scale_weight"))
            same = same and file_scale is not None and torch.equal(scale.float().reshape(()), file_scale.float())
        if not same:
            storage_mismatch.append(key)
        if key in reference:
            ref = reference[key].float()
            effective = _effective(sub, name, param)
            fp8 = FP8 in (stored.dtype, data.dtype)
            rel = _REL[FP8] + _REL[torch.bfloat16] if fp8 else _REL.get(data.dtype, 0.0)
            layer_scale = 1.0
            if fp8:
                layer = key[: -len(".weight")]
                s = file_tensors.get(f"{layer}.weight_scale", file_tensors.get(f"{layer}.scale_weight"))
                layer_scale = float(s) if s is not None and data.dtype == FP8 else 1.0
            tol = ref.abs() * rel + (layer_scale * 2.0**-9 if fp8 else 0.0) + 1e-7
            if effective.shape != ref.shape or not bool(((effective - ref).abs() <= tol).all()):
                off_tolerance.append(key)
    return {"storage_mismatch": storage_mismatch, "off_tolerance": off_tolerance, "checked": checked}


def _child_experts(records: _Records, job: dict) -> dict:
    import comfy.ldm.wan.model
    import comfy.ops
    import comfy.sd
    import comfy.utils

    out = {"cases": {}, "model": job["model"], "current_scheme": hasattr(comfy.utils, "convert_old_quants")}
    m = job["model"]
    with torch.device("meta"):
        reference_model = comfy.ldm.wan.model.VaceWanModel(
            model_type="vace",
            dim=m["dim"],
            ffn_dim=m["ffn_dim"],
            num_heads=m["num_heads"],
            num_layers=m["num_layers"],
            in_dim=m["in_dim"],
            text_dim=m["text_dim"],
            vace_layers=m["vace_layers"],
            vace_in_dim=m["vace_in_dim"],
            operations=comfy.ops.disable_weight_init,
        )
    comfy_shapes = {k: tuple(v.shape) for k, v in reference_model.state_dict().items()}
    references = {p: load_file(p) for p in set(job["reference"].values())}
    ours = {k: tuple(v.shape) for k, v in references[job["reference"]["bf16"]].items()}
    out["keys"] = {
        "comfy_shapes": comfy_shapes,
        "only_ours": sorted(set(ours) - set(comfy_shapes)),
        "only_comfy": sorted(set(comfy_shapes) - set(ours)),
        "shape_mismatch": sorted(k for k in set(ours) & set(comfy_shapes) if ours[k] != comfy_shapes[k]),
    }
    linears = sorted(name for name, module in reference_model.named_modules() if isinstance(module, torch.nn.Linear))
    del reference_model

    for name, paths in job["cases"].items():
        records.messages.clear()
        result = {"error": None}
        try:
            if paths[0].endswith(".gguf"):
                arch, tensors = sf.read_gguf(paths[0])
                assert arch == "wan", arch
                file_tensors = {k: torch.from_numpy(values.copy()) for k, (_, values) in tensors.items()}
                patcher = comfy.sd.load_diffusion_model_state_dict(dict(file_tensors))
            elif len(paths) == 1:
                file_tensors = _file_tensors(paths)
                patcher = comfy.sd.load_diffusion_model(paths[0])
            else:
                # KJNodes' DiffusionModelLoaderKJ: base file, VACE module merged in, prefix stripped.
                file_tensors = _file_tensors(paths)
                sd, metadata = comfy.utils.load_torch_file(paths[0], return_metadata=True)
                sd.update(comfy.utils.load_torch_file(paths[1]))
                prefix = comfy.sd.model_detection.unet_prefix_from_state_dict(sd)
                sd = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=False)
                patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
            model = patcher.model
            config = dict(model.model_config.unet_config)
            result["model_class"] = type(model).__name__
            result["diffusion_model_class"] = type(model.diffusion_model).__name__
            result["unet_config"] = {k: v for k, v in config.items() if isinstance(v, (int, str, float, bool))}
            result["missing"] = records.lists("unet missing")
            result["unexpected"] = records.lists("unet unexpected")
            result["left_over"] = records.lists("left over keys in diffusion model")
            params = _module_params(model.diffusion_model)
            # GGUF values are checked against the source in test_single_file_writers.py; here ComfyUI
            # must hold exactly the dequantised file.
            reference = {} if paths[0].endswith(".gguf") else references[job["reference"][name]]
            result.update(_compare_weights(params, file_tensors, reference))
            # Scales live inside 0.33's QuantizedTensors (compared by _compare_weights), not as parameters.
            bookkeeping = (".comfy_quant", ".weight_scale", ".input_scale", ".scale_weight", ".scale_input")
            result["not_loaded"] = sorted(
                k for k in file_tensors if k not in params and not (k == "scaled_fp8" or k.endswith(bookkeeping))
            )
            result["keys"] = {
                "comfy_quant": sorted(k for k in file_tensors if k.endswith(".comfy_quant")),
                "weight_scale": sorted(k for k in file_tensors if k.endswith(".weight_scale")),
                "scale_weight": sorted(k for k in file_tensors if k.endswith((".scale_weight", ".scale_input"))),
                "all_linear_scales": sorted(
                    f"{layer}.{s}" for layer in linears for s in ("scale_weight", "scale_input")
                ),
            }
            del patcher, model
        except Exception as error:  # reported, and failed, by the parent
            import traceback

            result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
        out["cases"][name] = result
    return out


def _child_vae(records: _Records, job: dict) -> dict:
    import comfy.ldm.wan.vae
    import comfy.sd
    import comfy.utils

    result = {"error": None}
    try:
        sd, metadata = comfy.utils.load_torch_file(job["path"], return_metadata=True)
        file_tensors = dict(sd)
        vae = comfy.sd.VAE(sd=sd, metadata=metadata)
        vae.throw_exception_if_invalid()
        model = vae.first_stage_model
        result["class"] = f"{type(model).__module__}.{type(model).__name__}"
        result["latent_channels"] = vae.latent_channels
        result["latent_dim"] = vae.latent_dim
        result["missing"] = records.lists("Missing VAE keys")
        result["unexpected"] = records.lists("Leftover VAE keys")
        with torch.device("meta"):
            fresh = comfy.ldm.wan.vae.WanVAE(
                dim=job["base_dim"],
                z_dim=16,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=2,
                attn_scales=[],
                temperal_downsample=[False, True, True],
            )
        comfy_shapes = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
        ours = {k: tuple(v.shape) for k, v in file_tensors.items()}
        result["only_ours"] = sorted(set(ours) - set(comfy_shapes))
        result["only_comfy"] = sorted(set(comfy_shapes) - set(ours))
        result["shape_mismatch"] = sorted(k for k in set(ours) & set(comfy_shapes) if ours[k] != comfy_shapes[k])
        loaded = model.state_dict()
        result["storage_mismatch"] = sorted(
            k for k, v in file_tensors.items() if k not in loaded or not torch.equal(loaded[k].float(), v.float())
        )
        reference = load_file(job["reference"])
        with torch.no_grad():
            images = vae.decode(reference["latent"])  # (1, frames, H, W, 3) in [0, 1]
        expected = ((reference["video"].clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1)
        result["decode_shape"] = list(images.shape)
        result["decode_max_error"] = float((images.float() - expected).abs().max())
    except Exception as error:
        import traceback

        result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
    return result


def _child_text_encoder(records: _Records, job: dict) -> dict:
    import comfy.sd
    import comfy.text_encoders.sd3_clip
    import sentencepiece

    # Core CLIPLoader(type=wan) recognises only the full-size UMT5-XXL (block 23, 10240-wide FFN); the
    # tiny file takes the same path with that size check answered for it. The rest is ComfyUI's own.
    comfy.sd.detect_te_model = lambda sd: comfy.sd.TEModel.T5_XXL
    comfy.sd.t5xxl_detect = lambda clip_data: comfy.text_encoders.sd3_clip.t5_xxl_detect(clip_data[0])
    out = {"files": {}}
    for name, path in job["files"].items():
        records.messages.clear()
        result = {"error": None}
        try:
            file_tensors = load_file(path)
            clip = comfy.sd.load_clip(
                [path], clip_type=comfy.sd.CLIPType.WAN, model_options={"umt5xxl_model_config": job["config"]}
            )
            te = clip.cond_stage_model
            t5 = te.umt5xxl.transformer
            result["te_class"] = f"{type(te).__module__}.{type(te).__name__}"
            result["t5_class"] = f"{type(t5).__module__}.{type(t5).__name__}"
            result["missing"] = records.lists("clip missing")
            result["unexpected"] = records.lists("clip unexpected")
            params = _module_params(t5)
            weights = {k: v for k, v in file_tensors.items() if k not in ("spiece_model", "scaled_fp8")}
            weights = {k: v for k, v in weights.items() if not k.endswith((".scale_weight", ".scale_input"))}
            result["only_file"] = sorted(set(weights) - set(params))
            result["only_comfy"] = sorted(
                k for k in set(params) - set(weights) if not k.endswith((".scale_weight", ".scale_input", "scaled_fp8"))
            )
            result["shape_mismatch"] = sorted(
                k for k in set(weights) & set(params) if tuple(weights[k].shape) != tuple(params[k][2].shape)
            )
            compared = _compare_weights(params, file_tensors, {})
            result["storage_mismatch"] = compared["storage_mismatch"]
            processor = sentencepiece.SentencePieceProcessor(model_proto=bytes(file_tensors["spiece_model"].tolist()))
            result["spiece_ids"] = processor.encode(job["prompt"])
            tokens = clip.tokenize(job["prompt"])
            ids = [int(t[0]) for t in tokens["umt5xxl"][0]]
            while ids and ids[-1] == 0:  # padding to 512
                ids.pop()
            result["tokenizer_ids"] = ids
            cond = clip.encode_from_tokens(tokens, return_dict=True)["cond"][0]
            embedding = str(Path(job["out_dir"]) / f"embedding-{name}.safetensors")
            save_file({"ids": torch.tensor(ids), "cond": cond.float().contiguous()}, embedding)
            result["embedding"] = embedding
        except Exception as error:
            import traceback

            result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
        out["files"][name] = result
    return out


def _child_main(argv: list[str]) -> None:
    group, comfy_dir, job_path, out_path = argv
    job = json.loads(Path(job_path).read_text())
    records = _import_comfy(comfy_dir)
    run = {"experts": _child_experts, "vae": _child_vae, "text_encoder": _child_text_encoder}[group]
    result = run(records, job)
    Path(out_path).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
