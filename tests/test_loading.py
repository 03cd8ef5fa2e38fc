"""Loading pipeline folders: streamed safetensors only, diffusers' dtype layout, clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanVACEPipeline
from safetensors.torch import load_file, save_file

from wanvace_core import WanVACEModelFolderError, inspect_pipeline_folder, load_pipeline
from wanvace_core.load.folder_layout import find_pipeline_folders

TRANSFORMER_FILE = Path("transformer") / "diffusion_pytorch_model.safetensors"


@pytest.fixture
def folder_copy(tiny_folder, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_folder, tmp_path / "copy"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_loaded_tensors_and_dtypes_equal_diffusers_from_pretrained(dtype, tiny_folder):
    ours = load_pipeline(tiny_folder, dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reference = WanVACEPipeline.from_pretrained(tiny_folder, torch_dtype=torch_dtype)
    for name in ("transformer", "transformer_2", "text_encoder", "vae"):
        expected = getattr(reference, name).state_dict()
        actual = getattr(ours, name).state_dict()
        assert expected.keys() == actual.keys(), name
        for key, tensor in expected.items():
            assert actual[key].dtype == tensor.dtype, (name, key)
            assert torch.equal(actual[key], tensor), (name, key)
        for key, buffer in getattr(reference, name).named_buffers():
            assert torch.equal(dict(getattr(ours, name).named_buffers())[key], buffer), (name, key)
    if dtype == "bf16":
        # diffusers keeps norms and time embeddings in fp32; a loader that forgets this drifts from it.
        assert ours.transformer.scale_shift_table.dtype == torch.float32
        assert ours.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert ours.boundary_ratio == 0.875
    assert ours.text_encoder.shared.weight is ours.text_encoder.encoder.embed_tokens.weight


def test_sharded_component_loads_like_single_file(folder_copy, tiny_folder):
    shard_dir = folder_copy / "transformer"
    state = load_file(str(shard_dir / "diffusion_pytorch_model.safetensors"))
    (shard_dir / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(state)
    middle = len(keys) // 2
    halves = {"part-00001-of-00002.safetensors": keys[:middle], "part-00002-of-00002.safetensors": keys[middle:]}
    weight_map = {}
    for file, names in halves.items():
        save_file({name: state[name] for name in names}, str(shard_dir / file))
        weight_map.update(dict.fromkeys(names, file))
    (shard_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    sharded = load_pipeline(folder_copy, "fp32")
    single = load_pipeline(tiny_folder, "fp32")
    for key, tensor in single.transformer.state_dict().items():
        assert torch.equal(sharded.transformer.state_dict()[key], tensor), key


def test_truncated_weight_file_is_refused_naming_the_file(folder_copy):
    path = folder_copy / TRANSFORMER_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(WanVACEModelFolderError, match="truncated") as error:
        inspect_pipeline_folder(folder_copy)
    assert str(path) in str(error.value)
    with pytest.raises(WanVACEModelFolderError, match="truncated"):
        load_pipeline(folder_copy, "fp32")


def test_pickle_only_component_is_refused_and_never_opened(folder_copy):
    path = folder_copy / TRANSFORMER_FILE
    path.unlink()
    (path.parent / "diffusion_pytorch_model.bin").write_bytes(b"not a pickle: opening it would fail loudly")
    with pytest.raises(WanVACEModelFolderError, match="pickle"):
        load_pipeline(folder_copy, "fp32")


def test_missing_weight_file_is_refused(folder_copy):
    (folder_copy / TRANSFORMER_FILE).unlink()
    with pytest.raises(WanVACEModelFolderError, match=r"has no \.safetensors weights"):
        inspect_pipeline_folder(folder_copy)


def test_missing_component_folder_is_refused(folder_copy):
    shutil.rmtree(folder_copy / "vae")
    with pytest.raises(WanVACEModelFolderError, match="vae"):
        inspect_pipeline_folder(folder_copy)


def test_other_pipeline_class_is_refused(folder_copy):
    index_path = folder_copy / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "WanPipeline"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WanVACEModelFolderError, match="'WanPipeline' pipeline, not WanVACEPipeline"):
        inspect_pipeline_folder(folder_copy)


def test_folder_without_model_index_is_refused(tmp_path):
    with pytest.raises(WanVACEModelFolderError, match=r"no model_index\.json"):
        inspect_pipeline_folder(tmp_path)


def test_two_experts_without_boundary_ratio_are_refused(folder_copy):
    index_path = folder_copy / "model_index.json"
    index = json.loads(index_path.read_text())
    del index["boundary_ratio"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(WanVACEModelFolderError, match="boundary_ratio"):
        inspect_pipeline_folder(folder_copy)


def test_missing_tensor_is_refused_naming_it(folder_copy):
    path = folder_copy / TRANSFORMER_FILE
    state = load_file(str(path))
    del state["proj_out.weight"]
    save_file(state, str(path))
    with pytest.raises(WanVACEModelFolderError, match=r"proj_out\.weight"):
        load_pipeline(folder_copy, "fp32")


def test_foreign_tensor_is_refused_naming_it(folder_copy):
    path = folder_copy / TRANSFORMER_FILE
    state = load_file(str(path))
    state["lora_unet_extra.weight"] = torch.zeros(2)
    save_file(state, str(path))
    with pytest.raises(WanVACEModelFolderError, match=r"lora_unet_extra\.weight"):
        load_pipeline(folder_copy, "fp32")


def test_unknown_dtype_is_refused(tiny_folder):
    with pytest.raises(WanVACEModelFolderError, match="dtype='int8'"):
        load_pipeline(tiny_folder, "int8")


def test_find_pipeline_folders_lists_nested_folders(tmp_path, tiny_folder):
    shutil.copytree(tiny_folder, tmp_path / "a" / "wan")
    (tmp_path / "b").mkdir()
    assert find_pipeline_folders([tmp_path, tmp_path / "missing"]) == ["a/wan"]


def test_find_pipeline_folders_follows_linked_folders_and_survives_a_link_loop(tmp_path, tiny_folder):
    # Users keep weights on another disk and link the folder into models/diffusers.
    root = tmp_path / "diffusers"
    (root / "disk").mkdir(parents=True)
    (root / "disk" / "wan").symlink_to(tiny_folder, target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    assert find_pipeline_folders([root]) == ["disk/wan"]
