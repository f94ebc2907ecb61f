"""scripts/box_split.py's sorting of a machine's perf samples by thread class (its pure part)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import box_split  # noqa: E402

# tid -> (pid, thread name): a launcher (10), its zygote (11), a peer (20: its loop, compute thread,
# a libuv worker), the peer's p2pd (30), and a process of neither side (99)
THREADS = {10: (10, "python"), 11: (11, "python"), 20: (20, "python"), 21: (20, "stage-compute"),
           22: (20, "libuv-worker"), 30: (30, "p2pd"), 31: (30, "p2pd"), 99: (99, "sshd")}


def test_our_threads_are_sorted_by_role():
    c = box_split.classify("ours", {10, 11, 20, 30}, THREADS)
    assert c == {10: "launcher", 11: "launcher", 20: "event loop", 21: "compute", 22: "other peer threads",
                 30: "p2p daemon", 31: "p2p daemon"}


def test_a_rank_computes_on_its_main_thread_and_its_other_threads_are_gloos():
    threads = {40: (40, "python"), 41: (40, "gloo_tcp_loop"), 42: (40, "pt_gloo_runloop"), 99: (99, "sshd")}
    assert box_split.classify("theirs", {40}, threads) == {40: "compute", 41: "gloo", 42: "gloo"}


def test_samples_count_by_class_with_the_kernels_apart():
    lines = "\n".join([
        "         python    20/21    7f00aa ([JIT] tid 20)",
        "         python    20/21    7f00ab (/x/libtorch_cpu.so)",
        "         python    20/20    ffffffff81 ([kernel.kallsyms])",
        "         python    20/20    7f00ac (/usr/lib/libpython3.11.so.1.0)",
        "        swapper     0/0     ffffffff82 ([kernel.kallsyms])",
        "  kworker/1:2-mm    77/77   ffffffff83 ([kernel.kallsyms])",
        "garbage that is no sample",
    ])
    classes = box_split.classify("ours", {10, 11, 20, 30}, THREADS)
    assert box_split.split(lines, classes) == {"compute": (2, 0), "event loop": (2, 1), "idle": (1, 1),
                                              "rest of the machine": (1, 1)}
