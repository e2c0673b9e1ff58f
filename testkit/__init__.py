"""What the tests (``tests/``) and the benchmarks (``bench/``) share: child processes
that print their result as JSON (:mod:`testkit.child`), the fork server that starts
those children without a fresh interpreter each (:mod:`testkit.zygote`) and a real
sglang PD pair in two processes (:mod:`testkit.sglang_pair`).

Not part of kvmem: pyproject.toml installs ``kvmem*`` only, so this package is found
only from the repository root (pytest's rootdir, ``python -m bench.<name>``), as
``bench`` is.  kvmem itself never imports it.
"""
