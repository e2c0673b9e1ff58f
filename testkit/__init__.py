"""What the tests (``tests/``) and the benchmarks (``bench/``) share: child processes
that print their result as JSON (:mod:`testkit.child`), the fork server that starts
those children without a fresh interpreter each (:mod:`testkit.zygote`), a real sglang
PD pair in two processes (:mod:`testkit.sglang_pair`) and the 64 GiB CPU twin of a GPU
pool (:mod:`testkit.twin`).

Not part of kvmem: pyproject.toml installs ``kvmem*`` only, so this package is found
only from the repository root (pytest's rootdir, ``python -m bench.<name>``), as
``bench`` is.  kvmem itself never imports it.
"""
