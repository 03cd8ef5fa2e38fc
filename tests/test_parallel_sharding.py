"""FSDP2-sharded experts loaded per rank straight from the files (`wanvace_core.parallel.sharding`).

Every check runs on real gloo ranks (one CPU thread each: the module's `rank_pools`, spawned once per world
size, except where a test measures a rank's memory and gets fresh ones from `tests.support.distributed.run_ranks`) and
compares, inside each rank, against the unsharded loaders run in that same process (same thread count, so the
same CPU kernels): the folder loader (`load_pipeline`) and the single-file loader (`load_expert_files`).
Unsharded weights used in place from a file sit at the file's offsets, and CPU GEMM kernels pick their
path by operand alignment, so the references are re-homed into fresh allocations first (as in
tests/test_single_file.py): the comparison is of the values loaded, not of where they lie.

The tiny pipeline here has ffn_dim 70, so at 4 shards the FFN rows split 18/18/18/16 (FSDP pads the
last shards; the loader must still read exactly each rank's rows), and its low-noise expert is saved
as several safetensors shards with an index, as the real A14B folder is.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import sys

import pytest
import torch
from diffusers import WanVACETransformer3DModel
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from bench.expert_files import PREFIX, original_wan_state_dict, write_expert
from bench.rss import PeakSampler, random_transformer, read_status
from tests.support.distributed import run_ranks
from tests.support.single_files import truncate_copy
from tests.support.vace_tasks import NEGATIVE, PROMPT
from wanvace_core import (
    ExpertFiles,
    SamplerSettings,
    VACEInputs,
    WanVACEError,
    WanVACEModel,
    load_expert_files,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.load.folder_layout import ComponentFiles
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline
from wanvace_core.load.weight_files import give_back_freed_heap
from wanvace_core.parallel.sharding import (
    load_sharded_expert,
    local_shard_bytes,
    meta_experts,
    prefetch_in_order,
    shard_and_fill,
    shard_expert,
)
from wanvace_core.runtime.interleave import apply_interleaved_vace, current_execution_order, uses_interleaved_vace
from wanvace_core.runtime.plan import RuntimePlan, apply_plan

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
FFN_DIM = 70  # not a multiple of 4: uneven dim-0 shards
STEPS = 4  # with the default boundary 0.875 and shift 3, both experts run
WIDTH, HEIGHT, LENGTH = 32, 32, 5
TORCH_DTYPE_NAMES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


# --------------------------------------------------------------------------------------------------
# Fixtures (parent process): the files every rank reads


def load_sharded_experts(source, dtype, mesh, device, cpu_offload: bool = False, *, weight_dtype: str = "auto") -> dict:
    """Every expert of a pipeline folder or of single files, sharded (`shard_and_fill` over `meta_experts`)."""
    return {
        name: shard_and_fill(expert, sources, mesh, device, cpu_offload)
        for name, (expert, sources) in meta_experts(source, dtype, weight_dtype=weight_dtype).items()
    }


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny two-expert pipeline; `transformer_2` re-saved as several shards plus an index file."""
    folder = write_tiny_pipeline(tmp_path_factory.mktemp("sharding") / "tiny", TinyModelSpec(ffn_dim=FFN_DIM))
    low = folder / "transformer_2"
    model = WanVACETransformer3DModel.from_pretrained(low)
    shutil.rmtree(low)
    model.save_pretrained(low, safe_serialization=True, max_shard_size="100KB")
    assert len(list(low.glob("*.safetensors"))) > 1 and list(low.glob("*.safetensors.index.json"))
    return folder


def _mesh(world: int, shape: tuple[int, ...]):
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    assert torch.Size(shape).numel() == world
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _rehomed(model):
    with torch.no_grad():
        for module in model.components.values():
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.data = tensor.data.clone()
    return model


def _inputs():
    """An inpainting request (control video and masks), small enough that the ranks spend their time on the experts."""
    frames = torch.rand(LENGTH, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(5))
    masks = torch.zeros(LENGTH, HEIGHT, WIDTH)
    masks[:, 8:24, 8:24] = 1.0
    return VACEInputs(
        positive=PROMPT,
        negative=NEGATIVE,
        width=WIDTH,
        height=HEIGHT,
        length=LENGTH,
        control_video=frames,
        control_masks=masks,
    )


def _settings():
    return SamplerSettings(seed=3, steps=STEPS, cfg=5.0, cfg_low_noise=4.0)


def _expert_output(expert, cond, dtype) -> torch.Tensor:
    noise = torch.randn(
        cond.conditioning_latents.shape[0],
        16,
        *cond.conditioning_latents.shape[2:],
        generator=torch.Generator().manual_seed(11),
    )
    with torch.no_grad():
        return expert(
            hidden_states=noise.to(dtype),
            timestep=torch.tensor([700]),
            encoder_hidden_states=cond.prompt_embeds,
            control_hidden_states=cond.conditioning_latents,
            control_hidden_states_scale=cond.conditioning_scale,
            return_dict=False,
        )[0]


def _around(reference, experts):
    """A `WanVACEModel` sharing the reference's text encoder, VAE and tokenizer, with the sharded experts."""
    model = WanVACEModel(
        source=reference.source,
        dtype=reference.dtype,
        device=reference.device,
        tokenizer=reference.tokenizer,
        text_encoder=reference.text_encoder,
        vae=reference.vae,
        transformer=experts["transformer"],
        transformer_2=experts["transformer_2"],
        scheduler_config=reference.scheduler_config,
        boundary_ratio=reference.boundary_ratio,
        weights=reference.weights,
    )
    apply_plan(model, RuntimePlan())  # the interleaved forward, installed over the FSDP-sharded experts
    return model


def _layout_facts(expert) -> dict:
    """What is sharded and what is held whole, and how many bytes this rank holds."""
    whole = sorted(name for name, param in expert.named_parameters() if not isinstance(param, DTensor))
    whole_dtypes = {str(param.dtype) for param in expert.parameters() if not isinstance(param, DTensor)}
    sharded_dtypes = {str(param.dtype) for param in expert.parameters() if isinstance(param, DTensor)}
    full = sum(t.numel() * t.element_size() for t in [*expert.parameters(), *expert.buffers()])
    return {
        "whole": whole,
        "whole_dtypes": whole_dtypes,
        "sharded_dtypes": sharded_dtypes,
        "held": local_shard_bytes(expert),
        "full": full,
        "rope_equal": None,
    }


def _counter(calls: dict, name: str):
    def count(*_):
        calls[name] += 1

    return count


def sharded_against_unsharded(rank, world, folder, shape, cpu_offload, prefetch, dtypes):
    """Per dtype: each expert's forward and the whole `sample` from sharded experts vs the folder loader."""
    mesh = _mesh(world, shape)
    results = {}
    for dtype in dtypes:
        reference = _rehomed(load_pipeline(folder, dtype))
        experts = load_sharded_experts(folder, dtype, mesh, "cpu", cpu_offload)
        facts = _layout_facts(experts["transformer"])  # before a forward gathers the root's parameters
        model = _around(reference, experts)
        if prefetch:
            for expert in experts.values():
                prefetch_in_order(expert, current_execution_order(expert))
        cond = prepare_conditioning(reference, _inputs())
        torch_dtype = reference.transformer_dtype
        forward = {}
        for name in ("transformer", "transformer_2"):
            ours, theirs = (
                _expert_output(experts[name], cond, torch_dtype),
                _expert_output(getattr(reference, name), cond, torch_dtype),
            )
            forward[name] = (torch.equal(ours, theirs), (ours.float() - theirs.float()).abs().max().item())
        calls = {"transformer": 0, "transformer_2": 0}
        hooks = [experts[name].register_forward_pre_hook(_counter(calls, name)) for name in calls]
        ours = sample(model, cond, _settings()).latents
        for hook in hooks:
            hook.remove()
        # Every rank's latents are compared with rank 0's, so only rank 0 runs the unsharded sampler.
        theirs = sample(reference, cond, _settings()).latents if rank == 0 else ours
        facts["rope_equal"] = all(
            torch.equal(a, b)
            for a, b in zip(experts["transformer"].rope.buffers(), reference.transformer.rope.buffers(), strict=True)
        )
        results[dtype] = {
            "forward": forward,
            "sample_equal": torch.equal(ours, theirs),
            "sample_max_diff": (ours - theirs).abs().max().item(),
            "latents": ours,
            "calls": calls,
            "interleaved": all(uses_interleaved_vace(expert) for expert in experts.values()),
            "facts": facts,
        }
    return results


def _check_exact(results, world: int, shards: int, dtypes) -> None:
    for dtype in dtypes:
        per_rank = [result[dtype] for result in results]
        for rank, result in enumerate(per_rank):
            where = f"rank {rank}, {dtype}"
            assert result["interleaved"], where
            for name, (equal, diff) in result["forward"].items():
                assert equal, f"{where}: {name} forward differs from the unsharded expert by {diff}"
            assert result["sample_equal"], (
                f"{where}: latents differ from the unsharded run by {result['sample_max_diff']}"
            )
            assert result["calls"]["transformer"] > 0 and result["calls"]["transformer_2"] > 0, (where, result["calls"])
            facts = result["facts"]
            assert facts["rope_equal"], f"{where}: the RoPE tables did not survive to_empty"
            if dtype == "fp32":
                assert facts["whole"] == [] and facts["sharded_dtypes"] == {"torch.float32"}, (where, facts)
            else:
                # Only the fp32-kept parameters (time embedder, norms, scale-shift tables) are held whole.
                assert facts["whole_dtypes"] == {"torch.float32"}, (where, facts)
                assert facts["sharded_dtypes"] == {TORCH_DTYPE_NAMES[dtype]}, (where, facts)
                assert "condition_embedder.time_embedder.linear_1.weight" in facts["whole"], where
                assert all(
                    any(part in ("time_embedder", "norm2", "scale_shift_table") for part in name.split("."))
                    for name in facts["whole"]
                ), (where, facts["whole"])
            # Each rank holds about 1/shards of the expert (plus what is whole), never the full expert.
            assert facts["held"] < facts["full"] / shards * 1.25 + 64 * 1024, (where, facts["held"], facts["full"])
        for rank in range(1, world):
            assert torch.equal(per_rank[rank]["latents"], per_rank[0]["latents"]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize(
    ("world", "shape", "prefetch"),
    [
        pytest.param(2, (2,), False, id="fsdp2"),
        pytest.param(4, (4,), True, id="fsdp4-prefetch"),
        pytest.param(4, (2, 2), True, id="hsdp2x2-prefetch"),
    ],
)
def test_sharded_experts_equal_the_unsharded_model_bitwise(rank_pools, tiny_folder, world, shape, prefetch):
    dtypes = ("bf16", "fp16", "fp32") if world == 2 else ("bf16", "fp32")
    results = rank_pools(world).run(sharded_against_unsharded, tiny_folder, shape, False, prefetch, dtypes)
    _check_exact(results, world, shape[-1], dtypes)


def test_cpu_offloaded_shards_are_exact_too(rank_pools, tiny_folder):
    dtypes = ("bf16",)
    results = rank_pools(2).run(sharded_against_unsharded, tiny_folder, (2,), True, True, dtypes)
    _check_exact(results, 2, 2, dtypes)


# --------------------------------------------------------------------------------------------------
# Memory: each rank's private memory grows by its shard, not by the expert


RATIO = 1.2
# Python and torch objects of the meta-built expert and of FSDP's per-parameter bookkeeping (~200 parameters,
# each a DTensor over a padded shard), measured 3.5-5 MiB above the shard in torch 2.8 and 2.11 alike; the
# file is read through mapped windows (file-backed, unmapped after use), which cost no private memory.
ALLOWANCE = 16 * MIB
WINDOW = 64 * MIB  # at most one mapped window of the file is resident at a time (loading._WINDOW_BYTES)


@pytest.fixture(scope="module")
def large_expert_folder(tmp_path_factory):
    """A 227 MiB (bf16) random expert, dim 1024, 4 layers + 2 VACE blocks, saved as 64 MB shards + an index."""
    root = tmp_path_factory.mktemp("sharding-memory")
    model = random_transformer(num_layers=4, vace_every=2, num_attention_heads=8)
    model.save_pretrained(root / "transformer", safe_serialization=True, max_shard_size="64MB")
    del model
    index = {"_class_name": "WanVACEPipeline", "transformer": ["diffusers", "WanVACETransformer3DModel"]}
    (root / "model_index.json").write_text(json.dumps(index))
    return root / "transformer"


def measure_sharded_load(rank, world, component_folder, dtype):
    mesh = _mesh(world, (world,))
    files = ComponentFiles("transformer", component_folder, tuple(sorted(component_folder.glob("*.safetensors"))))
    # The model class, which diffusers imports lazily on first use (~48 MiB of modules), came in with this
    # module's imports, before the baseline, as in tests/test_load_memory.py: a worker has it already.
    sys.setswitchinterval(0.0005)  # let the sampler thread in often while the loader holds the GIL
    gc.collect()
    give_back_freed_heap()
    with PeakSampler() as peak:
        expert = load_sharded_expert(files, mesh, dtype=dtype, device="cpu")
    after = read_status()
    full = sum(t.numel() * t.element_size() for t in [*expert.parameters(), *expert.buffers()])
    return {
        **peak.as_dict(),
        "held": local_shard_bytes(expert),
        "full": full,
        "files": len(files.weight_files),
        "private_after": after["RssAnon"] - peak.baseline["RssAnon"],
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_each_rank_loads_only_its_shard(large_expert_folder, dtype):
    world = 2
    # Fresh ranks: a rank that already loaded and freed other models would start from another heap.
    results = run_ranks(world, measure_sharded_load, large_expert_folder, dtype)
    for rank, result in enumerate(results):
        held, full = result["held"], result["full"]
        budget = RATIO * held + ALLOWANCE
        report = (
            f"rank {rank}, {dtype}: expert {full / MIB:.0f} MiB, this rank's shard {held / MIB:.0f} MiB; peak "
            f"above baseline: private {result['private_above_baseline'] / MIB:.1f} MiB, file-backed "
            f"{result['file_above_baseline'] / MIB:.1f} MiB, total {result['total_above_baseline'] / MIB:.1f} MiB; "
            f"budget {budget / MIB:.0f} MiB ({result['samples']} samples, {result['files']} files)"
        )
        print(report)
        assert result["hwm_reset"], "the kernel refused to reset VmHWM; the total peak would include the imports"
        assert result["files"] > 1, report
        assert full > 200 * MIB, report  # big enough that the shard, not noise, dominates
        assert held < 0.55 * full, report  # two shards: about half each
        assert result["private_above_baseline"] <= budget, report
        assert result["total_above_baseline"] <= budget + WINDOW, report
        # A real copy was measured (the shard is private memory), and it is far from a full expert.
        assert result["private_above_baseline"] >= 0.9 * held, report
        assert result["private_above_baseline"] <= 0.65 * full, report
        assert result["private_after"] <= held + ALLOWANCE, report


# --------------------------------------------------------------------------------------------------
# Single files (original Wan key layout) and refusals


@pytest.fixture(scope="module")
def single_files(comfy_components_default, comfy_model_files, tmp_path_factory):
    """ComfyUI-style files of one COMFY_SHAPED pipeline (head dim 128, as the layouts infer it): the session's
    models/ tree (bf16, fp8_scaled, Q8_0, umt5_fp16, vae used here) plus fp16, fp32 and .pth experts."""
    components = comfy_components_default
    written = dict(comfy_model_files.written)
    experts = tmp_path_factory.mktemp("sharding-single")
    pairs = (("high", "transformer"), ("low", "transformer_2"))
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        written[name] = {
            expert: write_expert(
                experts / f"{expert}_{name}.safetensors", components[component], dtype=dtype, prefix=PREFIX
            )
            for expert, component in pairs
        }
    # A weights-only .pth of the original keys (read only with allow_pth).
    written["pth"] = {}
    for expert, component in pairs:
        state = {key: value.to(torch.bfloat16) for key, value in original_wan_state_dict(components[component]).items()}
        torch.save(state, experts / f"{expert}.pth")
        written["pth"][expert] = experts / f"{expert}.pth"
    return written


def _expert_files(written, fmt: str):
    return ExpertFiles(
        high_noise_model=written[fmt]["high"],
        low_noise_model=written[fmt]["low"],
        text_encoder=written["umt5_fp16"],
        vae=written["vae"],
        allow_pth=fmt == "pth",
    )


# (expert file format, dtype, weight_dtype)
SINGLE_FILE_CASES = (
    ("bf16", "bf16", "auto"),
    ("fp16", "bf16", "auto"),
    ("fp32", "fp32", "auto"),  # with the model.diffusion_model. prefix
    ("bf16", "fp32", "bf16"),  # Linear weights held in bf16 (QuantizedLinear "cast"), the rest fp32
    ("fp8_scaled", "bf16", "auto"),  # fp8 weights kept as stored, sharded; scales whole
    ("fp8_scaled", "bf16", "bf16"),  # dequantised at load
    ("Q8_0", "bf16", "bf16"),  # dequantised at load, rows of whole Q8_0 blocks
    ("pth", "bf16", "auto"),  # a weights-only .pth (memory-mapped): rows are slices of its tensors
)
STORED_DTYPES = {"fp8_scaled-bf16-auto": "torch.float8_e4m3fn"}


def _synthetic_output(expert, dtype: torch.dtype) -> torch.Tensor:
    """One interleaved forward on random inputs of the expert's own sizes (2 x 4 x 4 latents, 8 tokens)."""
    config = expert.config
    generator = torch.Generator().manual_seed(2)
    latents = torch.randn(1, config.in_channels, 2, 4, 4, generator=generator)
    control = torch.randn(1, config.vace_in_channels, 2, 4, 4, generator=generator)
    text = torch.randn(1, 6, config.text_dim, generator=generator)
    with torch.no_grad():
        return expert(
            hidden_states=latents.to(dtype),
            timestep=torch.tensor([600]),
            encoder_hidden_states=text.to(dtype),
            control_hidden_states=control.to(dtype),
            return_dict=False,
        )[0]


def _unequal_local_shards(expert, reference) -> list[str]:
    """Keys whose local shard differs from DTensor's own split of the unsharded tensor (no communication)."""
    theirs = reference.state_dict()
    unequal = []
    for key, tensor in expert.state_dict().items():
        if isinstance(tensor, DTensor):
            expected = distribute_tensor(theirs[key], tensor.device_mesh, tensor.placements, src_data_rank=None)
            same = torch.equal(tensor.to_local(), expected.to_local())
        else:
            same = torch.equal(tensor, theirs[key])
        if not same:
            unequal.append(key)
    return unequal


def single_files_against_unsharded(rank, world, written, cases):
    """Per case and expert: the local shards and the forward vs the single-file loader's expert."""
    mesh = _mesh(world, (world,))
    results = {}
    for fmt, dtype, weight_dtype in cases:
        files = _expert_files(written, fmt)
        reference = _rehomed(load_expert_files(files, dtype, weight_dtype))
        experts = load_sharded_experts(files, dtype, mesh, "cpu", weight_dtype=weight_dtype)
        case = {}
        for name, expert in experts.items():
            theirs_module = getattr(reference, name)  # with the interleaved forward (the loader composes it)
            unequal = _unequal_local_shards(expert, theirs_module)
            apply_interleaved_vace(expert)
            dtype_used = reference.transformer_dtype
            ours, theirs = _synthetic_output(expert, dtype_used), _synthetic_output(theirs_module, dtype_used)
            expert.reshard()  # the root keeps its parameters gathered after a forward
            case[name] = {
                "unequal_shards": unequal[:5],
                "forward_equal": torch.equal(ours, theirs),
                "sharded_dtypes": {str(p.dtype) for p in expert.parameters() if isinstance(p, DTensor)},
                "held": local_shard_bytes(expert),
                "full": sum(t.numel() * t.element_size() for t in [*expert.parameters(), *expert.buffers()]),
            }
        results["-".join((fmt, dtype, weight_dtype))] = case
    return results


def test_single_file_experts_shard_bitwise_equal_to_the_single_file_loader(rank_pools, single_files):
    results = rank_pools(2).run(single_files_against_unsharded, single_files, SINGLE_FILE_CASES)
    for rank, per_case in enumerate(results):
        assert set(per_case) == {"-".join(case) for case in SINGLE_FILE_CASES}
        for case, experts in per_case.items():
            assert set(experts) == {"transformer", "transformer_2"}, (rank, case)
            for name, result in experts.items():
                assert result["unequal_shards"] == [], (rank, case, name, result)
                assert result["forward_equal"], (rank, case, name)
                # About half each (plus the RoPE tables and fp32-kept parameters, whole on both ranks).
                assert result["held"] < 0.65 * result["full"], (rank, case, name, result)
                if case in STORED_DTYPES:
                    # Kept as stored: the sharded Linear weights are the file's fp8 bytes.
                    assert STORED_DTYPES[case] in result["sharded_dtypes"], (rank, case, name, result)
        kept, plain = per_case["fp8_scaled-bf16-auto"], per_case["bf16-bf16-auto"]
        assert kept["transformer"]["held"] < 0.7 * plain["transformer"]["held"], (kept, plain)


def refusals(rank, world, tiny_folder, broken_folder, written, cut_expert, foreign_expert):
    """Each broken input and the message it is refused with (None when it loaded)."""
    mesh = _mesh(world, (world,))

    def message(load):
        try:
            load()
        except WanVACEError as error:
            return f"{type(error).__name__}: {error}"
        return None

    def single(model):
        return ExpertFiles(high_noise_model=model, text_encoder=written["umt5_fp16"], vae=written["vae"])

    real = load_pipeline(tiny_folder, "bf16").transformer
    return {
        "truncated_folder": message(lambda: load_sharded_experts(broken_folder["truncated"], "bf16", mesh, "cpu")),
        "missing_tensor": message(lambda: load_sharded_experts(broken_folder["missing"], "bf16", mesh, "cpu")),
        "misshapen_tensor": message(lambda: load_sharded_experts(broken_folder["misshapen"], "bf16", mesh, "cpu")),
        "truncated_file": message(lambda: load_sharded_experts(single(cut_expert), "bf16", mesh, "cpu")),
        "foreign_tensor": message(lambda: load_sharded_experts(single(foreign_expert), "bf16", mesh, "cpu")),
        "gguf_kept": message(lambda: load_sharded_experts(_expert_files(written, "Q8_0"), "bf16", mesh, "cpu")),
        "real_weights": message(lambda: shard_expert(real, mesh, dtype="bf16")),
        "wrong_device": message(lambda: load_sharded_experts(tiny_folder, "bf16", mesh, "cuda:0")),
    }


@pytest.fixture(scope="module")
def broken_folders(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding-broken")
    folders = {}
    for kind in ("truncated", "missing", "misshapen"):
        folders[kind] = shutil.copytree(tiny_folder, root / kind)
    weights = folders["truncated"] / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    for kind, edit in (
        ("missing", lambda state: state.pop("blocks.1.ffn.net.0.proj.weight")),
        ("misshapen", lambda state: state.__setitem__("blocks.1.ffn.net.0.proj.weight", torch.zeros(3, 32))),
    ):
        path = folders[kind] / "transformer" / "diffusion_pytorch_model.safetensors"
        state = load_file(str(path))
        edit(state)
        save_file(state, str(path))
    return folders


def test_broken_files_and_misuse_are_refused(rank_pools, tiny_folder, broken_folders, single_files, tmp_path):
    cut = truncate_copy(single_files["bf16"]["high"], tmp_path / "cut_high.safetensors")
    foreign = tmp_path / "foreign_high.safetensors"
    state = load_file(str(single_files["bf16"]["high"]))
    state["blocks.0.self_attn.extra.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(state, str(foreign))
    # Every refusal comes before any collective (the headers are checked first), on every rank alike.
    per_rank = rank_pools(2).run(refusals, tiny_folder, broken_folders, single_files, cut, foreign)
    expected = {
        "truncated_folder": r"WanVACEModelFolderError: Weight file .*truncated/transformer/diffusion_pytorch_model"
        r"\.safetensors is truncated.*re-download",
        "missing_tensor": r"missing/transformer lacks 1 tensor\(s\) of WanVACETransformer3DModel "
        r"\(blocks\.1\.ffn\.net\.0\.proj\.weight\); the download is incomplete",
        "misshapen_tensor": r"misshapen/transformer/diffusion_pytorch_model\.safetensors stores "
        r"'blocks\.1\.ffn\.net\.0\.proj\.weight' with shape \[3, 32\], WanVACETransformer3DModel expects \[70, 32\]",
        "truncated_file": r"cut_high\.safetensors is truncated or corrupt at tensor .*re-download",
        "foreign_tensor": r"foreign_high\.safetensors holds tensor 'blocks\.0\.self_attn\.extra\.weight', which "
        r"WanVACETransformer3DModel does not have",
        "gguf_kept": r"WanVACEInputError: weight_dtype='auto' keeps the Q8_0 GGUF blocks of high_noise_model "
        r"\(Wan2\.2-VACE-Fun-A14B-high-noise-Q8_0\.gguf\) as stored, which FSDP cannot shard.*Use weight_dtype bf16 "
        r"with sharding",
        "real_weights": r"shard_expert needs an expert built on the meta device, but '.+' \(and \d+ more\) holds real",
        "wrong_device": r"device=cuda:0 does not match the shard mesh's device type 'cpu'",
    }
    for rank, results in enumerate(per_rank):
        for case, pattern in expected.items():
            assert results[case] is not None, f"rank {rank}: {case} was not refused"
            assert re.search(pattern, results[case], re.DOTALL), f"rank {rank}, {case}: {results[case]}"
