"""The server launcher, one module per job.

- `install.py`: the tritonserver tree (from nvidia-pytriton) and the environment its python stubs need;
- `repository.py`: the run copy of `model_repository/` with each model's parameters filled in;
- `process.py`: `TritonServer`, one tritonserver process (start, readiness, clean stop);
- `supervisor.py`: restarts a server that dies or loses a python stub; `procs.py`: /proc and /dev/shm plumbing;
- `cli.py`: `python -m triton_vlm.server` / `triton-vlm-serve`, with its smoke requests.
"""
