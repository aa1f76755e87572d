"""Device decisions (`video_dit.devices`) without a GPU: where a launch's ranks go under the GPU
counts and CUDA_VISIBLE_DEVICES a scheduler hands out (torch's count stubbed), what the memory plan
counts for the same command line, `--device` checks, and preset builds that give the same weights
whatever the device context and without touching the global or CUDA generators."""

from __future__ import annotations

import socket

import pytest
import torch

from video_dit import devices
from video_dit.devices import DeviceError, placement


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` GPUs (of 80 GiB)."""
    def set_count(n: int, visible: str | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: type("P", (), {"total_memory": 80 * 2 ** 30})())
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return set_count


def test_every_visible_gpu_counted_by_torch_without_nvidia_smi(gpus, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi anywhere: torch's count decides
    gpus(4)
    p = placement([])
    assert (p.ranks, p.device, p.gpus) == (4, "cuda", (0, 1, 2, 3))
    assert p.runner([]) == ["--num_gpus", "4"] and p.env == {}


def test_scheduler_visible_devices_become_include(gpus):
    """CUDA_VISIBLE_DEVICES=2,3: DeepSpeed's runner given --num_gpus would drop it and use GPUs 0-1."""
    gpus(2, visible="2,3")
    p = placement([])
    assert (p.ranks, p.gpus) == (2, (2, 3)) and p.runner([]) == ["--include", "localhost:2,3"]
    # the user's --num_gpus under CUDA_VISIBLE_DEVICES: the first N visible, named, and --num_gpus dropped
    p = placement(["--num_gpus", "1", "--master_port", "1234"])
    assert p.runner(["--num_gpus", "1", "--master_port", "1234"]) == ["--include", "localhost:2", "--master_port", "1234"]
    assert p.ranks == 1 and "GPUs [2]" in p.note


def test_users_choice_is_kept_and_checked(gpus, tmp_path):
    gpus(4)
    p = placement(["--num_gpus", "2"])
    assert (p.ranks, p.runner(["--num_gpus", "2"])) == (2, ["--num_gpus", "2"])
    assert placement(["--include", "localhost:1,3"]).gpus == (1, 3)
    with pytest.raises(DeviceError, match=r"--num_gpus 8: torch sees 4 GPU\(s\) here"):
        placement(["--num_gpus", "8"])
    with pytest.raises(DeviceError, match=r"--include localhost:5: GPU\(s\) \[5\] are not visible here"):
        placement(["--include", "localhost:5"])
    hosts = tmp_path / "hostfile"
    hosts.write_text("node1 slots=8\nnode2 slots=8  # second node\n")
    p = placement(["--hostfile", str(hosts)])
    assert (p.ranks, p.nodes, p.ranks_per_node) == (16, 2, 8)


def test_no_gpu_two_cpu_ranks_with_the_cores_shared(gpus):
    gpus(0, visible="")
    p = placement([])
    assert (p.ranks, p.device) == (2, "cpu") and p.runner([]) == ["--num_gpus", "2"]
    assert p.env == {"OMP_NUM_THREADS": str(max(1, (__import__("os").cpu_count() or 2) // 2))}
    assert "no GPU visible" in p.note
    with pytest.raises(DeviceError, match="one local host is planned here"):
        placement(["--include", "host2:0"])


def test_the_plan_counts_the_ranks_the_launcher_starts(gpus):
    from video_dit.train.plan import preflight  # noqa: F401  (the plan reads `machine_of(placement(args))`)

    gpus(2, visible="4,6")
    machine = devices.machine_of(placement([]))
    assert (machine.ranks, machine.device, machine.gpu_mem) == (2, "cuda", 80 * 2 ** 30)
    assert devices.machine_of(placement(["--num_gpus", "1"])).ranks == 1


def test_device_flag_checked_against_what_torch_sees(gpus):
    gpus(0)
    with pytest.raises(DeviceError, match="--device cuda: torch sees no CUDA GPU here"):
        devices.resolve_device("cuda")
    assert devices.resolve_device(None).type == "cpu"
    with pytest.raises(DeviceError, match="accepted: cpu, cuda, cuda:N"):
        devices.resolve_device("tpu")
    gpus(2)
    with pytest.raises(DeviceError, match=r"torch sees 2 GPU\(s\) \(cuda:0 \.\. cuda:1\)"):
        devices.resolve_device("cuda:3")


def test_dit_init_draws_on_the_cpu_under_any_default_device():
    """Each DiT parameter's initial values are drawn on the CPU (`init_parameter`) and copied to where
    the parameter lives, so a build under a GPU's device context gets the CPU build's weights (meta
    stands in for cuda here: values drawn on the default device would be lost and the copy fail)."""
    from video_dit.families import get_preset
    from video_dit.families.wan.dit import init_parameter
    from video_dit.models.common import parameter_generator

    cfg = get_preset("tiny").dit
    for name, shape in (("blocks.0.ffn.0.weight", (cfg.ffn_dim, cfg.dim)), ("blocks.0.modulation", (1, 6, cfg.dim))):
        plain = init_parameter(cfg, name, torch.empty(shape), parameter_generator(3, name))
        with torch.device("meta"):
            inside = init_parameter(cfg, name, torch.empty(shape, device="cpu"), parameter_generator(3, name))
        assert torch.equal(plain, inside) and plain.std() > 0, name


@pytest.mark.parametrize("source", ["preset:tiny", "preset:tiny-clip-i2v"])
def test_preset_builds_draw_from_their_own_seed_and_leave_every_generator(source, monkeypatch):
    """The DiT, VAE, text and image encoders of a preset: the same weights twice, other weights for
    another seed, the global generator's state unchanged, and the CUDA generators never reseeded
    (`torch.manual_seed` would reseed them: a GPU run would then get another random VAE than the CPU
    run whose latent cache it reuses)."""
    from video_dit.families.wan.loading import load_dit, load_image_encoder, load_text_encoder, load_vae

    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))

    def weights(seed):
        out = {"dit": load_dit(source, seed=seed).state_dict(), "vae": load_vae("preset:tiny", seed=seed).state_dict(),
               "te": load_text_encoder(source).model.state_dict()}
        if source == "preset:tiny-clip-i2v":
            out["clip"] = load_image_encoder(source).model.state_dict()
        return out

    torch.manual_seed(123)
    reseeded.clear()
    before = torch.random.get_rng_state()
    first, again = weights(3), weights(3)
    assert torch.equal(torch.random.get_rng_state(), before) and reseeded == []
    for part, sd in first.items():
        for name, t in sd.items():
            assert torch.equal(t, again[part][name]), (part, name)
    other = weights(4)
    assert not torch.equal(other["dit"]["blocks.0.ffn.0.weight"], first["dit"]["blocks.0.ffn.0.weight"])
    assert not torch.equal(other["vae"]["encoder.conv1.weight"], first["vae"]["encoder.conv1.weight"])


@pytest.mark.parametrize("setting, device, zero, sp, expected", [
    ("auto", "cuda", 2, 1, True), ("auto", "cpu", 2, 1, False), ("auto", "cuda", 3, 1, False),
    ("auto", "cuda", 2, 2, False), (True, "cpu", 3, 2, True), (False, "cuda", 2, 1, False)])
def test_compile_auto_is_on_for_gpu_ranks_under_zero_0_2_without_sp(setting, device, zero, sp, expected):
    from types import SimpleNamespace

    from video_dit.train.build import compiles

    process = SimpleNamespace(train=SimpleNamespace(compile=setting),
                              deepspeed=SimpleNamespace(zero_stage=zero, sequence_parallel_size=sp))
    assert compiles(process, torch.device(device)) is expected


def test_free_port_is_below_the_ephemeral_range_and_free(tmp_path, monkeypatch):
    """MASTER_PORT comes from below the kernel's ephemeral range (where outgoing connections cannot take it
    between the check and the bind), is free, and falls back to a kernel-chosen port where that range
    starts too low to leave room."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(devices, "EPHEMERAL_RANGE", ranges)
    ports = {devices.free_port() for _ in range(20)}
    assert all(devices.PORTS_BELOW_EPHEMERAL <= p < 32768 for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: binds
    ranges.write_text("20500 60999\n")
    assert not devices.PORTS_BELOW_EPHEMERAL <= devices.free_port() < 20500  # no room below: the kernel's choice
