"""Run by tests/sglang/test_decode_resend.py in a process of its own, with the flag on: a
real sglang decode ``NixlKVManager`` (``testkit.sglang_pair``: its pool and metadata
buffers, NIXL/UCX on DRAM) that knows two prefill ranks (``connection_pool``, as its
receivers leave it once they met them), each a ZMQ PULL socket bound here where a prefill
rank's bootstrap thread would listen.  The decode's KV registration is taken back and made
again (the adapter's ``deregister_buffer_to_engine``, sglang's
``register_buffer_to_engine``), which sends the new registration to both ranks
(``kvmem_sglang.registrations.resend``).

The fault: the first send to rank ``b`` fails as sglang's send to a prefill rank that
does not take it fails (``zmq.Again`` from ``CommonKVReceiver._connect_to_bootstrap_server``'s
socket, past sglang's send timeout); every later send goes through.  Recorded: how long
the registration call took, what each rank received after it (whether each message is the
decode's new registration, sglang's ``KVArgsRegisterInfo`` read from it as a prefill's
bootstrap thread reads it) and when, and the adapter's log lines.  Prints one JSON object
on its last line.
"""

from __future__ import annotations

import logging
import time

from tests.sglang.sglang_env import script_main

SHAPE = dict(layers=2, heads=2, head_dim=64, page_size=16, requests=2, tokens=64)
FIRST_S = 0.3  # the adapter's first wait between tries, shortened for the test
WAIT_S = 20.0


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> dict:
    import zmq
    from kvmem_sglang import registrations
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.disaggregation.nixl.conn import KVArgsRegisterInfo
    from testkit.sglang_pair import build_pool, manager, metadata_buffers, publish, Shape

    shape = Shape(**SHAPE)
    sa = publish("decode", shape.page_size)  # loads the plugin (the flag is on)
    kv, _ = build_pool(shape)
    meta = metadata_buffers(shape.requests)
    dm = manager(kv, meta, "decode", sa)
    lines = _Lines()
    logging.getLogger("kvmem.sglang").addHandler(lines)
    logging.getLogger("kvmem.sglang").setLevel(logging.INFO)
    registrations.RESEND_FIRST_S = FIRST_S

    ctx = zmq.Context()
    ranks = {}
    for name in ("a", "b"):
        sock = ctx.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        ranks[name] = (sock, port)
    with dm.connection_lock:
        dm.connection_pool["127.0.0.1:8998_0_0"] = [
            {"rank_ip": "127.0.0.1", "rank_port": port} for _, port in ranks.values()
        ]
    failing = {ranks["b"][1]: 1}  # sends to refuse, by rank port
    real = CommonKVReceiver._connect_to_bootstrap_server.__func__

    def connect(cls, info):
        if failing.get(info["rank_port"], 0) > 0:
            failing[info["rank_port"]] -= 1
            raise zmq.Again("Resource temporarily unavailable")  # sglang's send timed out
        return real(cls, info)

    CommonKVReceiver._connect_to_bootstrap_server = classmethod(connect)

    dm.deregister_buffer_to_engine()
    t0 = time.monotonic()
    dm.register_buffer_to_engine()
    took = time.monotonic() - t0
    new = dm.build_receiver_registration_message()

    got: dict[str, list] = {name: [] for name in ranks}
    poller = zmq.Poller()
    for sock, _ in ranks.values():
        poller.register(sock, zmq.POLLIN)
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end and not all(got.values()):
        for sock, _ in poller.poll(50):
            msg = sock.recv_multipart()
            name = next(n for n, (s, _) in ranks.items() if s is sock)
            info = KVArgsRegisterInfo.from_zmq(msg[1:])  # as a prefill's bootstrap thread
            got[name].append(
                dict(
                    after_s=time.monotonic() - t0,
                    new=msg == new,
                    agent=info.agent_name,
                    kv_ptrs=info.dst_kv_ptrs == list(dm.kv_args.kv_data_ptrs),
                )
            )
    time.sleep(4 * FIRST_S)  # what comes after: nothing should
    extra = {name: 0 for name in ranks}
    for name, (sock, _) in ranks.items():
        while sock.poll(0):
            sock.recv_multipart()
            extra[name] += 1
    return dict(
        register_s=took,
        first_s=FIRST_S,
        got=got,
        extra=extra,
        refused_left=failing[ranks["b"][1]],
        lines=[line for line in lines.lines if "registration" in line],
        ports={name: port for name, (_, port) in ranks.items()},
    )


if __name__ == "__main__":
    script_main(main)
