"""Settings as values: the kernel and engine configs, the environment read in one module only, and
the package's layers importing only downwards."""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import subprocess
import sys

import pytest

from rosejax.settings import EngineConfig, KernelConfig, select_gpus

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_defaults_every_kernel_cpu_none(monkeypatch):
    for name in ("ROSEJAX_PALLAS_ATTENTION", "ROSEJAX_PALLAS_LINEAR", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ROSEJAX_FUSED_QK_ROPE", raising=False)
    monkeypatch.delenv("ROSEJAX_FUSED_SWIGLU", raising=False)
    gpu = KernelConfig.for_backend("gpu")
    assert (gpu.kv_append, gpu.attention, gpu.layer_norm, gpu.linear) == ("pallas",) * 4
    assert gpu.fused_kv_append and gpu.fused_qk_rope and gpu.fused_swiglu
    cpu = KernelConfig.for_backend("cpu")
    assert (cpu.kv_append, cpu.attention, cpu.layer_norm, cpu.linear) == ("xla",) * 4
    assert cpu == KernelConfig()
    monkeypatch.setenv("ROSEJAX_FUSED_SWIGLU", "0")
    assert not KernelConfig.for_backend("gpu").fused_swiglu


def test_environment_fills_defaults_and_overrides_win(monkeypatch):
    monkeypatch.setenv("ROSEJAX_PALLAS_ATTENTION", "off")
    monkeypatch.setenv("ROSEJAX_FUSED_KV_APPEND", "0")
    monkeypatch.setenv("ROSEJAX_FUSED_QK_ROPE", "off")
    monkeypatch.setenv("ROSEJAX_PALLAS_LINEAR_MAX_ROWS", "32")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    config = KernelConfig.for_backend("gpu", linear="xla")
    assert config.attention == "xla" and config.layer_norm == "pallas"
    assert not config.fused_kv_append and config.linear_max_rows == 32
    assert not config.fused_qk_rope
    assert config.linear == "xla"  # the explicit override
    monkeypatch.setenv("ROSEJAX_PALLAS_LINEAR_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="ROSEJAX_PALLAS_LINEAR_MAX_ROWS must be an integer"):
        KernelConfig.for_backend("gpu")


def test_decode_compiler_options_per_batch_and_xla_flags_win(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("ROSEJAX_CUBLAS_MIN_BATCH", "64")
    config = KernelConfig.for_backend("gpu")
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert config.decode_compiler_options(63) == concurrent
    assert config.decode_compiler_options(64) == {**concurrent, "xla_gpu_enable_triton_gemm": False}
    # A flag the user set in XLA_FLAGS is theirs: the config leaves it to XLA.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert KernelConfig.for_backend("gpu").decode_compiler_options(256) == concurrent
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=LHS")
    assert KernelConfig.for_backend("gpu").decode_compiler_options(256) == {
        "xla_gpu_enable_triton_gemm": False
    }


def test_configs_are_hashable_values_and_check_their_fields():
    a = KernelConfig(attention="pallas", tiles=(("attention", "num_warps", 2),))
    b = KernelConfig(attention="pallas", tiles=(("attention", "num_warps", 2),))
    assert a == b and hash(a) == hash(b) and a != KernelConfig()
    assert a.tile_kwargs("attention") == {"num_warps": 2} and a.tile_kwargs("linear") == {}
    with pytest.raises(ValueError, match="kernels.attention must be one of"):
        KernelConfig(attention="triton")
    with pytest.raises(ValueError, match="tile override"):
        KernelConfig(tiles=(("matmul", "num_warps", 2),))
    for rows in (0, 17):  # the one-kernel step's rows a step
        with pytest.raises(ValueError, match="decoder_step_rows must be 1 to 16"):
            KernelConfig(decoder_step_rows=rows)
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(model="random:tiny", decode_steps=0)
    with pytest.raises(ValueError, match="open_decode_steps"):
        EngineConfig(model="random:tiny", open_decode_steps=0)
    with pytest.raises(ValueError, match="decode_steps_per_trip"):
        EngineConfig(model="random:tiny", decode_steps_per_trip=0)
    for field in ("max_prefill_tokens", "prefill_chunk_tokens"):  # the chunk defaults to the first
        with pytest.raises(ValueError, match=f"{field} must be >= 1"):
            EngineConfig(model="random:tiny", **{field: 0})
    with pytest.raises(ValueError, match="idle_gather_ms"):
        EngineConfig(model="random:tiny", idle_gather_ms=-1)
    with pytest.raises(ValueError, match="idle_gather_max_ms"):
        EngineConfig(model="random:tiny", idle_gather_max_ms=-1)
    with pytest.raises(ValueError, match="at most one"):
        EngineConfig(model="random:tiny", kv_cache_tokens=64, kv_cache_memory_fraction=0.5)


def test_engine_config_reads_the_environment_when_made(monkeypatch):
    monkeypatch.setenv("ROSEJAX_MIN_DECODE_BATCH", "8")
    monkeypatch.setenv("ROSEJAX_COMPILATION_CACHE_DIR", "/tmp/rosejax-cache-test")
    config = EngineConfig(model="random:tiny")
    monkeypatch.setenv("ROSEJAX_MIN_DECODE_BATCH", "2")
    assert config.min_decode_batch == 8  # a value: later changes of the environment don't reach it
    assert config.compilation_cache_dir == "/tmp/rosejax-cache-test"
    assert EngineConfig(model="random:tiny", min_decode_batch=4).min_decode_batch == 4


def _sources(*packages: str):
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize(
    ("given", "indices", "expected"),
    [("", [2, 3], "2,3"), ("7,5,3", [1, 2], "5,3"), ("GPU-a,GPU-b", [0], "GPU-a")],
)
def test_select_gpus_picks_positions_of_the_given_gpus(monkeypatch, given, indices, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", given)  # restored after the test
    select_gpus(indices, "--data-parallel-size")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_select_gpus_beyond_the_given_names_the_flag(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(ValueError, match="lower --data-parallel-size"):
        select_gpus([2, 3], "--data-parallel-size")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for path in _sources("rosejax", "pallas_kernels"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in ("environ", "getenv", "environb"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers and all(r.startswith("rosejax/settings.py:") for r in readers), readers


# Lower layers first: a module may import from its own layer and those before it, never after.
LAYERS = [
    ["pallas_kernels"],
    [
        "rosejax.settings",
        "rosejax.compilation_cache",
        "rosejax.sampling",
        "rosejax.tokenizer",
        "rosejax.host_inputs",
    ],
    ["rosejax.layers"],
    ["rosejax.models"],
    ["rosejax.model_runner"],
    ["rosejax.engine"],
    ["rosejax.llm", "rosejax.engine_args"],
    ["rosejax.generate", "rosejax.serve", "rosejax"],
]


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer"
    return best[0]


def test_no_import_runs_back_up_the_layers():
    upward = []
    for path in _sources("rosejax", "pallas_kernels"):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in ("rosejax", "pallas_kernels"):
                    if _layer(target) > _layer(module):
                        upward.append(f"{module} imports {target}")
    assert not upward, upward


def test_importing_rosejax_changes_no_process_setting():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "import os, rosejax; print(repr(os.environ.get('XLA_FLAGS')))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None"


def test_kernel_flags_start_no_backend_and_reach_the_engine():
    """--kernel / --kernel-tile travel as overrides: parsing them starts no jax backend (an API
    server or data-parallel parent would take the engine processes' GPU memory); the engine
    applies them to its backend's defaults; a bad value fails at parse time."""
    code = """
import argparse
from jax._src import xla_bridge
from rosejax import EngineConfig
from rosejax.engine_args import add_engine_args, engine_kwargs
p = argparse.ArgumentParser()
add_engine_args(p)
args = p.parse_args(["--kernel", "linear_max_rows=8", "--kernel-tile", "linear.num_warps=2"])
config = EngineConfig(model="random:tiny", **engine_kwargs(args))
assert not xla_bridge._backends, xla_bridge._backends
kernels = config.kernel_config()
assert kernels.linear_max_rows == 8 and kernels.tile_kwargs("linear") == {"num_warps": 2}
try:
    engine_kwargs(p.parse_args(["--kernel", "linear_max_rows=-1"]))
except ValueError as e:
    print("refused:", e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "refused: " in out.stdout and "linear_max_rows" in out.stdout
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(
            model="random:tiny", kernels=KernelConfig(), kernel_overrides=(("linear", "xla"),)
        )


def test_decode_steps_per_trip_flag_reaches_the_config():
    from rosejax.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, want in (
        ([], EngineConfig.decode_steps_per_trip),
        (["--decode-steps-per-trip", "3"], 3),
    ):
        config = EngineConfig(model="random:tiny", **engine_kwargs(p.parse_args(argv)))
        assert config.decode_steps_per_trip == want


WRITE_A_CACHE_ENTRY = """
import sys
from rosejax.settings import configure_process
configure_process(sys.argv[1])
from jax._src.lru_cache import LRUCache
print("ready", flush=True)
sys.stdin.readline()
LRUCache(sys.argv[1], max_size=-1).put("entry", open(sys.argv[2], "rb").read())
"""


def test_compilation_cache_entries_appear_whole(tmp_path):
    """A process reading jax's cache while another writes an entry sees none of it or all of it
    (jax wrote entries in place: a reader got torn executables, which XLA segfaulted on)."""
    cache, value = tmp_path / "cache", os.urandom(64 << 20)
    (tmp_path / "value").write_bytes(value)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITE_A_CACHE_ENTRY, str(cache), str(tmp_path / "value")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "ready\n"
    writer.stdin.write("\n")
    writer.stdin.flush()
    entry, sizes = cache / "entry-cache", set()
    while writer.poll() is None:  # the sizes the entry's path has while it is written
        try:
            sizes.add(entry.stat().st_size)
        except FileNotFoundError:
            pass
    assert writer.returncode == 0
    sizes.add(entry.stat().st_size)
    assert sizes == {len(value)}
    assert entry.read_bytes() == value
    assert [p.name for p in cache.iterdir()] == ["entry-cache"]  # no partial file left
