"""kvmem's benchmarks (pytest-benchmark, ``make bench``) and the measurement scripts run
with ``python -m bench.<name>``."""


def print_table(lines: list[str], md: str | None) -> None:
    """Print a script's Markdown table; with ``md`` (a path) also append it there, as
    ``bench/results`` files collect a script's runs."""
    print("\n".join(lines))
    if md:
        with open(md, "a") as f:
            f.write("\n".join(lines) + "\n\n")
