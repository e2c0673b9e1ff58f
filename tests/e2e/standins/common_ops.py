"""Stand-in for sgl_kernel's compiled ``common_ops`` on a CPU-only host (see
``sitecustomize.py`` beside this file, item 1): ``sgl_kernel/load_utils.py`` imports a
module of this name when no compiled library loads.  It defines nothing, so any call
that would need a ``torch.ops.sgl_kernel`` op fails loudly instead of computing
something else."""
