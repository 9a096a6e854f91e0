"""Drives PyTorch's own TCPStore clients against a store server, for the compatibility tests
(1.13 here; on a GPU machine, scripts/gpu-check.sh runs it with that machine's PyTorch 2.x, and
the steps for 2.x-only methods run there).

Run with /usr/bin/python3 (Debian's python3-torch 1.13; the pyenv python3 on PATH has no torch).

  torch_store_ops.py serve
      Hosts PyTorch's own TCPStore server (the oracle) on 127.0.0.1, a free port. Prints
      "PORT <n>" and serves until stdin closes or the process is signalled.
  torch_store_ops.py client HOST PORT
      Runs a fixed scenario of store operations as TCPStore clients (is_master=False) and prints
      one line per step: "<step> <result>", where result is the return value or the exception.
      The caller runs the same scenario against PyTorch's server and against trun's, and compares
      the outputs line by line: PyTorch is the oracle, nothing here states an expected result.
      Ends with "END <steps>" when the scenario ran to completion.
"""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

# The store timeout of most connections: two steps wait it out (a get() of a missing key), so it
# is most of a run's time; every other request on loopback answers in milliseconds.
TIMEOUT = timedelta(seconds=2)
SHORT = timedelta(milliseconds=300)


def set_synced(store, key, value):
    """set() has no reply; a round trip on the same connection makes sure the server has applied
    it before another client looks (requests on one connection are served in order)."""
    store.set(key, value)
    store.num_keys()


def serve():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(f"PORT {store.port}", flush=True)
    sys.stdin.read()  # the test closes our stdin (or kills us) when it is done


class Scenario:
    def __init__(self, host, port):
        self.host = host
        self.port = port
        self.steps = 0

    def connect(self, world_size=2, timeout=TIMEOUT):
        return dist.TCPStore(self.host, self.port, world_size, False, timeout=timeout)

    def step(self, name, fn):
        try:
            result = repr(fn())
        except Exception as e:  # the exception is the result to compare
            result = f"raised {type(e).__name__}: {e}"
        self.steps += 1
        print(f"{name} {result}", flush=True)

    def run(self):
        a = self.connect()
        b = self.connect()
        s = self.step
        s("num_keys_initial", a.num_keys)

        # set / get, including binary and empty values, and overwrite.
        s("set", lambda: a.set("k", "v"))
        s("get", lambda: a.get("k"))
        s("get_from_other_client", lambda: b.get("k"))
        s("set_binary", lambda: a.set("bin", b"\x00\x01\xff\x00"))
        s("get_binary", lambda: b.get("bin"))
        s("set_empty", lambda: a.set("empty", b""))
        s("get_empty", lambda: a.get("empty"))
        s("overwrite", lambda: set_synced(b, "k", "v2"))
        s("get_overwritten", lambda: a.get("k"))
        s("set_long_key", lambda: a.set("x" * 1000, "long"))
        s("get_long_key", lambda: b.get("x" * 1000))

        # add: atomic counter stored as decimal text.
        s("add_new", lambda: a.add("cnt", 5))
        s("add_negative", lambda: b.add("cnt", -7))
        s("add_zero", lambda: a.add("cnt", 0))
        s("get_counter_text", lambda: a.get("cnt"))
        s("add_large", lambda: a.add("big", 2**62))
        s("add_large_again", lambda: a.add("big", 2**62 - 1))
        s("set_numeric_text", lambda: set_synced(a, "num", "41"))
        s("add_on_set_text", lambda: b.add("num", 1))

        # compare_set in all four cases.
        s("cas_missing_empty_expected", lambda: a.compare_set("cas1", "", "first"))
        s("cas_missing_empty_stored", lambda: b.get("cas1"))
        s("cas_missing_nonempty_expected", lambda: a.compare_set("cas2", "exp", "des"))
        s("cas_missing_nonempty_keys", a.num_keys)
        s("cas_missing_nonempty_not_created", lambda: b.wait(["cas2"], SHORT))
        s("cas_equal", lambda: a.compare_set("cas1", "first", "second"))
        s("cas_equal_stored", lambda: b.get("cas1"))
        s("cas_different", lambda: a.compare_set("cas1", "nope", "third"))
        s("cas_different_unchanged", lambda: b.get("cas1"))
        s("cas_empty_expected_existing", lambda: a.compare_set("cas1", "", "fourth"))

        # wait: present keys, no keys, keys set later by another client, partial sets.
        s("wait_present", lambda: a.wait(["k", "cnt"]))
        s("wait_present_with_timeout", lambda: a.wait(["k"], SHORT))
        s("wait_none", lambda: a.wait([]))

        def set_later(key, value, delay=0.2):
            t = threading.Thread(target=lambda: (time.sleep(delay), b.set(key, value)))
            t.start()
            return t

        t = set_later("late", "arrived")
        s("wait_for_later_set", lambda: a.wait(["late"]))
        t.join()
        s("get_later_set", lambda: a.get("late"))
        t = set_later("late_get", "got")
        s("get_blocks_until_set", lambda: a.get("late_get"))
        t.join()

        # wait times out; the same connection is then used again (1.13 sends nothing on timeout).
        s("wait_times_out", lambda: a.wait(["never"], SHORT))
        s("after_timeout_num_keys", a.num_keys)
        s("after_timeout_get", lambda: a.get("k"))
        s("wait_partial_times_out", lambda: b.wait(["k", "never2"], SHORT))
        s("after_partial_add", lambda: b.add("cnt", 1))
        s("get_missing_times_out", lambda: a.get("missing"))
        s("after_get_timeout_set", lambda: a.set("after", "ok"))
        s("after_get_timeout_get", lambda: b.get("after"))
        c = self.connect(timeout=timedelta(seconds=1))  # the store timeout also bounds get()
        s("get_missing_store_timeout", lambda: c.get("missing2"))
        s("set_timeout", lambda: c.set_timeout(TIMEOUT))
        s("after_set_timeout", lambda: c.get("k"))

        # delete_key and num_keys.
        s("num_keys_before_delete", a.num_keys)
        s("delete_existing", lambda: a.delete_key("k"))
        s("delete_again", lambda: b.delete_key("k"))
        s("delete_never_set", lambda: a.delete_key("nothing"))
        s("deleted_not_ready", lambda: b.wait(["k"], SHORT))
        s("num_keys_after_delete", a.num_keys)
        s("set_after_delete", lambda: b.set("k", "back"))
        s("get_after_delete", lambda: a.get("k"))

        # A new client adds init/ (world_size given) and sees every key.
        d = self.connect(world_size=3)
        s("num_keys_new_client", d.num_keys)
        s("new_client_get", lambda: d.get("cas1"))

        # The 1.13 client's wait timeout leaves the registration on the server; when the key
        # appears later the server sends a STOP_WAITING nobody reads, and it lands in front of
        # the next reply. Whatever the client makes of that, trun must do as PyTorch does.
        e = self.connect()
        s("stray_wait_times_out", lambda: e.wait(["stray"], SHORT))
        s("stray_key_set", lambda: set_synced(b, "stray", "1"))
        s("stray_next_reply", e.num_keys)
        s("stray_following_reply", lambda: e.get("stray"))

        # PyTorch 2.x clients only (1.13 has none of these, so its scenario is unchanged). Requests
        # without a reply are followed by a round trip on the same connection before another
        # client looks, as in set_synced.
        if hasattr(a, "multi_get"):
            s("append_new", lambda: a.append("app", "ab"))
            s("append_more", lambda: a.append("app", "cd"))
            s("append_synced", a.num_keys)
            s("append_get", lambda: b.get("app"))
            s("multi_set", lambda: a.multi_set(["m1", "m2"], ["1", "2"]))
            s("multi_set_synced", a.num_keys)
            s("multi_get", lambda: b.multi_get(["m2", "m1"]))
            s("check_present", lambda: b.check(["m1", "app"]))
            s("check_missing", lambda: b.check(["m1", "nope"]))
        if hasattr(a, "queue_push"):  # 2.7+
            s("queue_len_unknown", lambda: a.queue_len("q"))
            s("queue_pop_empty", lambda: a.queue_pop("q", block=False))
            s("queue_push_1", lambda: a.queue_push("q", "one"))
            s("queue_push_2", lambda: a.queue_push("q", b"two"))
            s("queue_len_2", lambda: a.queue_len("q"))
            s("queue_check", lambda: b.check(["q"]))
            s("queue_num_keys", b.num_keys)
            s("queue_pop_first", lambda: b.queue_pop("q", block=False))
            s("queue_pop_second", lambda: b.queue_pop("q"))
            s("queue_pop_drained", lambda: b.queue_pop("q", block=False))
            t = threading.Thread(target=lambda: (time.sleep(0.2), b.queue_push("q2", "late")))
            t.start()
            s("queue_pop_blocks_until_push", lambda: a.queue_pop("q2"))
            t.join()
            s("queue_pop_times_out", lambda: self.connect(timeout=SHORT).queue_pop("q3"))
        if hasattr(a, "list_keys"):  # after 2.9; key order is the server's hash order: sorted
            s("list_keys", lambda: sorted(b.list_keys()))
        if hasattr(a, "barrier"):  # after 2.9: the BARRIER query
            t = threading.Thread(target=lambda: b.barrier("bar", 2, TIMEOUT))
            t.start()
            s("barrier_two", lambda: a.barrier("bar", 2, TIMEOUT))
            t.join()
            s("barrier_counter", lambda: a.get("bar"))
            s("barrier_times_out", lambda: self.connect(timeout=SHORT).barrier("bar1", 2, SHORT))

        # add on a value that is not an integer: PyTorch's server drops that connection.
        f = self.connect()
        s("set_text", lambda: f.set("text", "abc"))
        s("add_on_text", lambda: f.add("text", 1))
        s("after_add_on_text", lambda: f.num_keys())
        s("others_unaffected", lambda: a.get("text"))
        s("num_keys_final", a.num_keys)
        print(f"END {self.steps}", flush=True)


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "serve":
        serve()
    elif len(sys.argv) == 4 and sys.argv[1] == "client":
        Scenario(sys.argv[2], int(sys.argv[3])).run()
    else:
        sys.exit(f"usage: {sys.argv[0]} serve | client HOST PORT")


if __name__ == "__main__":
    main()
