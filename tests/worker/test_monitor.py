"""The NVML monitor through the real pynvml bindings (fake library on CPU machines)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from accelsched import devices
from accelsched.devices import NVMLMonitor, cuda
from accelsched.testing import create_context, device_alloc, fake_gpus
from accelsched.testing.nvml_backend import SimulatedCuda


def test_inventory_in_cuda_order(fake_gpus_2) -> None:
    devices = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": "1,0"}).devices()
    assert [(d.index, d.nvml_index) for d in devices] == [(0, 1), (1, 0)]
    assert [d.uuid for d in devices] == [fake_gpus_2.uuids[1], fake_gpus_2.uuids[0]]
    assert all(d.memory == 16 * 2**30 for d in devices)
    assert NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": ""}).devices() == []
    by_uuid = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": fake_gpus_2.uuids[1]}).devices()
    assert [d.nvml_index for d in by_uuid] == [1]


def test_process_memory_exact(fake_gpus_2) -> None:
    m = NVMLMonitor(env={})
    before = m.process_memory(1)
    assert before == type(before)(0, True, False) or before.has_context is False
    create_context(device=1)
    ctx = m.process_memory(1)
    assert ctx.exact and ctx.has_context and ctx.nbytes == 64 * 2**20
    buf = device_alloc(2**20, device=1)
    assert m.process_memory(1).nbytes == 64 * 2**20 + 2**20
    assert m.used(1) >= m.process_memory(1).nbytes
    del buf


def test_no_per_process_figure_falls_back_to_device_wide(fake_gpus_2) -> None:
    m = NVMLMonitor(env={})
    device_alloc(2**20, device=0)
    fake_gpus_2.set_flags(process_memory=False)
    r = m.process_memory(0)
    assert not r.exact and r.nbytes == m.used(0) and r.has_context


def test_foreign_pid_namespace_falls_back_to_device_wide(fake_gpus_2) -> None:
    m = NVMLMonitor(env={})
    device_alloc(2**20, device=0)
    fake_gpus_2.set_flags(pid_offset=100000)
    r = m.process_memory(0)
    assert not r.exact and r.has_context is None and r.nbytes == m.used(0)


def test_no_nvml_library_means_zero_gpus_and_one_log_line() -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from accelsched.devices import NVMLMonitor;"
        "m = NVMLMonitor(); print(len(m.devices()), len(NVMLMonitor().devices()), m.reason)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELSCHED_", "LD_LIBRARY"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if "NVIDIA" in out.stdout and not out.stdout.startswith("0 "):
        pytest.skip("a real NVIDIA driver is installed here")
    assert out.stdout.startswith("0 0 NVML unavailable")
    assert out.stderr.count("no GPUs in this process") == 1


def test_no_pynvml_means_zero_gpus(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # simulates nvidia-ml-py not installed
    with caplog.at_level(logging.INFO):
        m = NVMLMonitor()
        assert m.devices() == [] and not m.available
    assert "pynvml is not installed" in (m.reason or "")


def test_driver_gone_after_session_means_zero_gpus() -> None:
    with fake_gpus(count=1):
        assert len(NVMLMonitor(env={}).devices()) == 1
    assert NVMLMonitor(env={}).devices() == []


def test_standin_answers_like_the_library(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ACCELSCHED_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="compiler"), fake_gpus(count=2, memory="8GiB") as g:
        assert g.standin
        m = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": "1"})
        (d,) = m.devices()
        assert (d.uuid, d.memory) == (g.uuids[1], 8 * 2**30)
        device_alloc(2**20, device=0)  # this process sees both: CUDA 0 is NVML 0
        assert NVMLMonitor(env={}).process_memory(0).has_context


# --- the backend is passed in -------------------------------------------------------------


def test_a_session_names_its_backend_and_marks_its_devices_simulated() -> None:
    assert "ACCELSCHED_NVML_BACKEND" not in os.environ
    with fake_gpus(count=1):
        assert os.environ["ACCELSCHED_NVML_BACKEND"] == "accelsched.testing.nvml_backend"
        m = NVMLMonitor(env={})
        assert len(m.devices()) == 1 and isinstance(cuda(), SimulatedCuda)
    assert "ACCELSCHED_NVML_BACKEND" not in os.environ  # restored
    assert not isinstance(cuda(), SimulatedCuda)


def test_the_environment_wins_over_a_config_snapshot(monkeypatch) -> None:
    """A nanny hands its workers its own config, a test harness restores a snapshot: the
    backend a process tree was started with still holds."""
    import dask

    with fake_gpus(count=1), dask.config.set({"accelsched.nvml-backend": "pynvml"}):
        m = NVMLMonitor(env={})
        assert len(m.devices()) == 1 and isinstance(cuda(), SimulatedCuda)


def test_backend_by_name(tmp_path, monkeypatch) -> None:
    """A backend is any module with pynvml's functions: here one that sees no driver."""
    (tmp_path / "nodriver.py").write_text(
        "class NVMLError(Exception): pass\n"
        "def nvmlInit():\n    raise NVMLError('Driver Not Loaded')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ACCELSCHED_NVML_BACKEND", "nodriver")
    m = NVMLMonitor(env={})
    assert m.devices() == [] and not m.available
    assert "Driver Not Loaded" in (m.reason or "")


@pytest.mark.parametrize(
    "value, said",
    [
        ("no_such_backend_module", "the NVML backend cannot be imported"),
        ("os; rm -rf", "is no module name"),
        ("", "is no module name"),
        # a relative name (before: a TypeError traceback from the import, not naming the
        # setting, and the worker ran on without its guard)
        (".pynvml", "is no module name"),
        ("pynvml.", "is no module name"),
    ],
)
def test_a_bad_backend_means_zero_gpus_and_says_which(monkeypatch, caplog, value, said) -> None:
    """A wrong setting, so a warning (a host without pynvml or a driver says so at INFO)."""
    monkeypatch.setenv("ACCELSCHED_NVML_BACKEND", value)
    monkeypatch.setattr(devices, "_logged", set())  # said once per process
    import dask

    with dask.config.set({"accelsched.nvml-backend": value}), caplog.at_level("INFO"):
        m = NVMLMonitor(env={})
        assert m.devices() == [] and not m.available
    assert said in (m.reason or ""), m.reason
    if value:
        assert repr(value) in (m.reason or "") or value in (m.reason or "")
    (record,) = [r for r in caplog.records if "no GPUs in this process" in r.getMessage()]
    assert record.levelname == "WARNING" and said in record.getMessage()
