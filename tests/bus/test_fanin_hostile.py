"""Fan-in against hostile endpoints files and long lists (issue 33): real files, real
sockets, real publishers; no engine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from actbus.bus import Batch, Publisher, Subscription
from actbus.bus.endpoints import MAX_ENDPOINTS, MAX_FILE_BYTES, Endpoints
from actbus.bus.fanin import FDS_PER_PUBLISHER, FanIn
from actbus.errors import ConfigError
from tests.bus.test_fanin import _msg
from tests.support.procs import wait_for


def test_thousands_of_ranges_are_refused_at_the_line_that_crosses_the_cap(tmp_path):
    """Issue 33, LOW: 5,000 ranges were all expanded and checked (14.7 s) before the cap
    applied. Now a range is counted before it is expanded, and the file is refused at
    the line that crosses ``MAX_ENDPOINTS``; a file over ``MAX_FILE_BYTES`` unread."""
    f = tmp_path / "endpoints.txt"
    f.write_text("".join(f"ipc://{tmp_path}/r{i}-{{0..999}}.sock\n" for i in range(5000)))
    with pytest.raises(ConfigError, match=r"line 2=.*: at most 1024 publishers in all"):
        Endpoints.parse(f"@{f}")
    f.write_text("".join(f"tcp://127.0.0.1:{2000 + i}\n" for i in range(MAX_ENDPOINTS + 1)))
    with pytest.raises(ConfigError, match=rf"line {MAX_ENDPOINTS + 1}: more than 1024"):
        Endpoints.parse(f"@{f}")
    f.write_text("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match=f"over {MAX_FILE_BYTES} bytes"):
        Endpoints.parse(f"@{f}")
    spec = ",".join(["tcp://127.0.0.1:{3000..3999}"] * 50)
    with pytest.raises(ConfigError, match="at most 1024 publishers in all"):
        Endpoints.parse(spec)


def _threads_and_fds() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def test_a_fan_in_shares_one_context_and_one_keepalive_thread(tmp_path):
    """Issue 33, LOW: 1,024 publishers opened 3,075 threads and 9,226 fds (a zmq
    Context and a keepalive thread each). Now one context and one keepalive thread for
    all, and about ``FDS_PER_PUBLISHER`` descriptors each."""
    n = 200
    spec = f"ipc://{tmp_path}/p-{{0..{n - 1}}}.sock"
    threads, fds = _threads_and_fds()
    with FanIn(spec, Subscription(name="many")) as fi:
        # Each publisher's data and keepalive sockets (the latter made by the keepalive
        # thread) hold at least 4 descriptors.
        wait_for(lambda: _threads_and_fds()[1] - fds >= 4 * n, 30, "the keepalive sockets")
        now_threads, now_fds = _threads_and_fds()
        more_threads, more_fds = now_threads - threads, now_fds - fds
        assert len(fi.publishers) == n
    assert more_threads <= 2, more_threads  # was 3 per publisher
    assert more_fds <= n * FDS_PER_PUBLISHER, more_fds


LOW_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from actbus.bus.fanin import FanIn
    from actbus.errors import ConfigError
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        FanIn(sys.argv[1]).close()
    except ConfigError as e:
        print("refused:", e)
    """
)


def test_more_publishers_than_the_open_file_limit_allows_are_refused_by_name(tmp_path):
    """Under ``ulimit -n 256``, 100 publishers (about 600 descriptors) are refused at
    start with an error naming ``ulimit -n``, not left to fail with EMFILE later."""
    r = subprocess.run(
        [sys.executable, "-c", LOW_LIMIT, f"ipc://{tmp_path}/p-{{0..99}}.sock"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "refused:" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "ulimit -n" in r.stdout and "RLIMIT_NOFILE" in r.stdout


@pytest.mark.timeout(120)
def test_a_flipping_endpoints_file_does_not_starve_the_stream(tmp_path):
    """Issue 33, LOW: an endpoints file rewritten over and over between lists that drop
    the live publisher made the fan-in let it go and subscribe again at every check, and
    the stream starved. Now a new list is taken only once it has settled."""
    live = f"ipc://{tmp_path}/live.sock"
    listing = tmp_path / "endpoints.txt"
    listing.write_text(live + "\n")
    pub = Publisher(live, info={"model": "test"}, heartbeat_s=0.1)
    stop = threading.Event()

    def flip() -> None:  # a new list without the live publisher every 50 ms: each of the
        k = 0  # fan-in's checks (one a second) finds another unsettled list, a flip
        while not stop.wait(0.05):
            k += 1
            listing.write_text(f"ipc://{tmp_path}/gone-{k}.sock\n")

    def feed() -> None:
        step = 0
        while not stop.wait(0.01):
            pub.publish(*_msg(step))
            step += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (flip, feed)]
    got = 0
    try:
        with FanIn(f"@{listing}", Subscription(window=8, policy="drop_oldest")) as fi:
            first = fi.publishers[live]
            for t in threads:
                t.start()
            end = time.monotonic() + 8  # eight file checks while it flips
            while time.monotonic() < end:
                if isinstance(fi.recv(timeout=0.5), Batch):
                    got += 1
            assert fi.publishers.get(live) is first, "the live publisher was let go"
            assert fi._watch.flips >= 2  # counted (and logged) as it flips
            assert first.stats.welcomes == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        pub.close(timeout=2)
    assert got >= 100, got  # the stream ran throughout (a step every 10 ms for 8 s)


def test_keyless_non_loopback_publishers_are_logged_as_insecure(tmp_path, caplog):
    """Issue 33, LOW: keyless non-loopback addresses in an endpoints file passed without
    a word. Now one INSECURE line names them; loopback and ipc ones need none."""
    f = tmp_path / "endpoints.txt"
    f.write_text(f"ipc://{tmp_path}/a.sock\ntcp://127.0.0.1:5999\ntcp://10.255.255.1:5555\n")
    with caplog.at_level(logging.WARNING, logger="actbus.fanin"), FanIn(f"@{f}"):
        pass
    lines = [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()]
    assert len(lines) == 1 and "tcp://10.255.255.1:5555" in lines[0], lines
    assert "127.0.0.1" not in lines[0] and "a.sock" not in lines[0]
    assert "server_key and client_secret_key" in lines[0]
