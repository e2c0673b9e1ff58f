"""How the repository's pytest runs end once they loaded NIXL
(``kvmem.transfer.nixl_exit``: a process that loaded NIXL leaves through ``finish``, which
skips the native destructors that crash on an RDMA host)."""

from __future__ import annotations

import sys


def finish_pytest(config, status) -> int:
    """For a conftest's ``pytest_cmdline_main`` wrapper, once pytest's command line has
    done everything (summary printed, junit XML and plugins' files written, unconfigure
    and clean-up run): ``kvmem.transfer.nixl_exit.finish`` with pytest's exit status when
    this pytest run is the process's own command line; else (``pytest.main()`` inside
    another program) the status as it is."""
    status = int(status)
    if tuple(config.invocation_params.args) == tuple(sys.argv[1:]):
        from kvmem.transfer.nixl_exit import finish

        return finish(status)
    return status
