"""`jetrouter up --prefill-workers N --decode-workers M`: engines p0.., d0.. with their roles."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.up import _plain_workers, add_arguments
from launch.local_cluster import LocalCluster


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_role_flags_name_the_engines_and_pass_their_role(tmp_path: Path) -> None:
    args = parse("--prefill-workers", "2", "--decode-workers", "3")
    assert _plain_workers(args) == 0
    assert _plain_workers(parse()) == 4
    assert _plain_workers(parse("--workers", "1", "--decode-workers", "1")) == 1
    c = LocalCluster(replicas=1, workers=1, prefill_workers=2, decode_workers=1,
                     data_dir=tmp_path, nats_url="nats://127.0.0.1:1")
    c._plan_children()
    roles = {}
    for name, child in c.children.items():
        if child.kind != "worker":
            continue
        c._finish_argv(child)
        argv = child.argv
        roles[name] = argv[argv.index("--role") + 1] if "--role" in argv else "both"
    assert roles == {"w0": "both", "p0": "prefill", "p1": "prefill", "d0": "decode"}
