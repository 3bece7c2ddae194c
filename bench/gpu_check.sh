#!/usr/bin/env bash
# A short check for a machine with an NVIDIA GPU and no Ray: the GPU tests, and one NVML reading.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 - <<'PY'
import torch, pynvml
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
u = pynvml.nvmlDeviceGetUtilizationRates(h); m = pynvml.nvmlDeviceGetMemoryInfo(h)
print("nvml: util", u.gpu, "% mem", m.used // 2**20, "/", m.total // 2**20, "MiB power",
      pynvml.nvmlDeviceGetPowerUsage(h) / 1000, "W sm clock", pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), "MHz")
PY
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -o addopts="" 2>&1 | tail -15
