"""The CPU decode kernels: C sources (`csrc/*.c`) compiled at first load on each machine (`cbuild`), each used only
where it is checked against torch and faster here: decode-sized products on oneDNN's packed weights (`gemv`), the
decode step's attention over the paged cache, norms and gate (`cpu_decode`), and a whole decode forward of 1-4 rows
in one call (`cpu_forward`). The engine's model (`engine/model/model.py`, `gemm.py`, `attention.py`) calls them."""
