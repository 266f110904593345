"""Mooncake Store's processes for scripts/lib/bench.sh.

store --segment BYTES: mount a segment and serve until SIGTERM.
client --op OP --size SIZE --batch BATCH --blocks BLOCKS --index INDEX
--clients CLIENTS --seconds SECONDS --barrier DIR: batched put (upsert: the
same keys again and again, as a kvplane PUT overwrites) or get of this
client's stride of the keys, timed from the moment every client is ready;
prints one JSON line."""
import argparse, ctypes, glob, json, mmap, os, signal, sys, time
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from bench_results import timed  # scripts/lib, this file's folder

def store(segment, local_buffer):
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", os.environ["MC_METADATA"], segment, local_buffer, "tcp", "", os.environ["MC_MASTER"])
    if rc != 0:
        sys.exit(f"MooncakeDistributedStore.setup answered {rc}")
    return s

def serve(segment):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    s = store(segment, 16 << 20)
    open(os.environ["MC_READY"], "w").close()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    s.close()

def client(op, size, batch, blocks, index, clients, seconds, barrier):
    area = mmap.mmap(-1, size * batch)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    one = bytes(i * 31 % 251 for i in range(size))
    for j in range(batch):
        area[j * size:(j + 1) * size] = one
    s = store(0, 16 << 20)
    if s.register_buffer(base, size * batch) != 0:
        sys.exit("register_buffer failed")
    ptrs = [base + j * size for j in range(batch)]
    mine = [f"bench/{i:08}" for i in range(index, blocks, clients)] or [f"bench/{index:08}"]
    chunks = [mine[i:i + batch] for i in range(0, len(mine), batch)]
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    def put(keys):
        rcs = s.batch_upsert_from(keys, ptrs[:len(keys)], [size] * len(keys), cfg)
        bad = [(k, r) for k, r in zip(keys, rcs) if r < 0]
        if bad:
            sys.exit(f"batch_upsert_from: {bad[:3]}")
    def get(keys):
        rcs = s.batch_get_into(keys, ptrs[:len(keys)], [size] * len(keys))
        bad = [(k, r) for k, r in zip(keys, rcs) if r != size]
        if bad:
            sys.exit(f"batch_get_into: {bad[:3]}")
    if op == "get":
        for c in chunks:
            put(c)
    open(os.path.join(barrier, f"ready.{index}"), "w").close()
    while len(glob.glob(os.path.join(barrier, "ready.*"))) < clients:
        time.sleep(0.001)
    print(json.dumps(timed(chunks, get if op == "get" else put, seconds)), flush=True)
    s.unregister_buffer(base)
    s.close()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    roles = parser.add_subparsers(dest="role", required=True)
    s = roles.add_parser("store", help="mount a segment and serve until SIGTERM")
    s.add_argument("--segment", required=True, type=int, help="bytes of the segment to mount")
    c = roles.add_parser("client", help="one timed client of a run")
    c.add_argument("--op", required=True, choices=["put", "get"])
    c.add_argument("--size", required=True, type=int, help="bytes per block")
    c.add_argument("--batch", required=True, type=int, help="blocks per call")
    c.add_argument("--blocks", required=True, type=int, help="distinct keys over all clients")
    c.add_argument("--index", required=True, type=int, help="this client's index, 0 to CLIENTS - 1")
    c.add_argument("--clients", required=True, type=int, help="client processes in the run")
    c.add_argument("--seconds", required=True, type=float, help="how long to run")
    c.add_argument("--barrier", required=True, help="folder where every client says it is ready")
    a = parser.parse_args()
    if a.role == "store":
        serve(a.segment)
    else:
        client(a.op, a.size, a.batch, a.blocks, a.index, a.clients, a.seconds, a.barrier)
