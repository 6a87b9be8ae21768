"""The server launcher, one module per job.

- `install.py`: the tritonserver tree (from nvidia-pytriton) and the environment its python stubs need;
- `repository.py`: the run copy of `model_repository/` with each model's parameters filled in;
- `gpu.py`: settings for a GPU start (the llm's default dtype, Triton's CUDA memory pool);
- `process.py`: `TritonServer`, one tritonserver process (command line, start, readiness, clean stop);
- `supervisor.py`: restarts supervised processes that die or lose a python stub; `procs.py`: /proc and /dev/shm
  plumbing and the spawner thread; `rundir.py`: run folders; `diagnose.py`: why a start failed, from the log;
- `cli.py`: `python -m triton_vlm.server` / `triton-vlm-serve`, with its smoke requests.
"""
