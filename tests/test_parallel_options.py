"""WanVACEParallelOptions' choices are validated before any work, with messages listing the valid ones."""

from __future__ import annotations

import pytest

from wanvace_core import WanVACEInputError
from wanvace_core.parallel import ParallelLayout, ParallelOptions
from wanvace_core.parallel.options import parse_devices


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        ("cpu,cpu", {"ulysses_degree": 3}, "ulysses_degree=3 must divide the 2 device(s) listed; valid choices: 1, 2"),
        ("cpu,cpu,cpu", {"cfg_parallel": True}, "cfg_parallel needs an even number of devices"),
        (
            "cpu,cpu,cpu,cpu",
            {"cfg_parallel": True, "ulysses_degree": 4},
            "ulysses_degree=4 must divide the 2 device(s) of each CFG branch; valid choices: 1, 2",
        ),
        ("cpu,cpu", {"shard": "hsdp", "replicate_size": 2}, "valid choices: none (hsdp needs at least 4 devices"),
        ("cpu,cpu,cpu,cpu", {"shard": "hsdp", "replicate_size": 3}, "replicate_size=3 with shard=hsdp"),
        ("cpu,cpu", {"replicate_size": 2}, "replicate_size=2 only applies to shard=hsdp"),
        ("cpu,cpu", {"shard": "zero3"}, "shard='zero3' is unknown; choose one of none, fsdp, hsdp"),
        ("cpu,cpu", {"launcher": "ray"}, "launcher='ray' is unknown; choose one of local, torchrun"),
        ("cpu,cpu", {"launcher": "torchrun", "endpoint": "localhost"}, "endpoint='localhost' is not host:port"),
        ("cpu,cpu", {"timeout_s": 0}, "timeout_s=0 must be above 0"),
        ("cpu", {"shard": "none"}, "one device with shard=none is the plain single-device path"),
        ("cuda:0,cpu", {}, "mixes CPU and GPU workers"),
        ("cuda:0,cuda:0", {}, "names cuda:0 more than once"),
        ("gpu0,gpu1", {}, "devices entry 'gpu0' is not a device"),
        ("", {}, "devices is empty"),
    ],
)
def test_invalid_combinations_are_refused_listing_the_valid_choices(devices, kwargs, message):
    with pytest.raises(WanVACEInputError) as refused:
        ParallelOptions.from_text(devices, **kwargs)
    assert message in str(refused.value)


def test_model_and_run_checks_name_the_valid_degrees():
    options = ParallelOptions.from_text("cpu,cpu,cpu", shard="fsdp", ulysses_degree=3)
    with pytest.raises(WanVACEInputError, match="does not divide the model's 40 attention heads; valid choices: 1, 2"):
        options.check_heads(40)
    options.check_heads(6)
    with pytest.raises(WanVACEInputError, match="does not divide this video's 1000 tokens"):
        options.check_tokens(1000)
    options.check_tokens(21 * 45 * 80)
    with pytest.raises(WanVACEInputError, match="this machine has 2 GPU"):
        ParallelOptions.from_text("cuda:0,cuda:1,cuda:2").check_devices(2)
    ParallelOptions.from_text("cuda:0,cuda:1").check_devices(2)
    cfg = ParallelOptions.from_text("cpu,cpu", shard="none", cfg_parallel=True)
    with pytest.raises(WanVACEInputError, match="both guidance scales"):
        cfg.check_guidance(1.0, 1.0)
    cfg.check_guidance(1.0, 3.5)


def test_the_a14b_head_count_allows_the_documented_degrees():
    for degree in (1, 2, 4, 8):
        ParallelOptions.from_text(",".join(["cpu"] * 8), ulysses_degree=degree).check_heads(40)
    ParallelOptions.from_text(",".join(["cpu"] * 5), ulysses_degree=5).check_heads(40)
    with pytest.raises(WanVACEInputError, match=r"40 attention heads; valid choices: 1, 2, 4, 5\.$"):
        ParallelOptions.from_text(",".join(["cpu"] * 6), ulysses_degree=3).check_heads(40)


def test_layout_groups_follow_the_documented_rank_order():
    layout = ParallelOptions.from_text(
        ",".join(["cpu"] * 8), shard="hsdp", replicate_size=2, cfg_parallel=True, ulysses_degree=2
    ).layout
    assert layout == ParallelLayout(world=8, cfg_size=2, ulysses_degree=2, shard="hsdp", replicate_size=2)
    assert [layout.branch_of(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.branch_rank(rank) for rank in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.ulysses_groups() == [[0, 1], [2, 3]]
    assert layout.shard_mesh_shape() == (2, 2)
    assert ParallelOptions.from_text("cpu,cpu,cpu,cpu").layout.shard_mesh_shape() == (4,)
    assert ParallelOptions.from_text("cpu,cpu", shard="none", ulysses_degree=2).layout.shard_mesh_shape() == ()


def test_devices_text_is_parsed_with_spaces_and_trailing_commas():
    assert parse_devices(" cuda:0, cuda:1 ,") == ("cuda:0", "cuda:1")
