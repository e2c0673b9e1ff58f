"""The kvmem kernels, one package per op (``pack``, ``alloc``), each with its Triton
kernels (``triton.py``), its CPU path (``cpu.py``) and its plain references (``ref.py``);
``_dispatch`` chooses between the Triton and the CPU path per call."""
