"""When the registry defragments etcd (services/registry/defrag.py), its flags, and the member URLs it dials
(services/store/etcd_maintenance.py); against real etcd: tests/integration/test_etcd_defrag.py."""

from __future__ import annotations

import pytest
from kvshuttle.services.common.config import ConfigError, from_namespace, load
from kvshuttle.services.registry.defrag import RATIO_FLOOR_BYTES, Defragmenter, should_defragment
from kvshuttle.services.registry.server import RegistryConfig
from kvshuttle.services.store.etcd_maintenance import MemberStatus, _host_port
from kvshuttle.services.store.etcd_store import EtcdStore

MIB = 1 << 20


@pytest.mark.parametrize(("size", "in_use", "want"), [
    (442 * MIB, 20 * MIB, True),  # the measured case: 422 MiB free after compaction
    (200 * MIB, 136 * MIB, False),  # 64 MiB free exactly: not more than the floor, and under half the file
    (200 * MIB, 135 * MIB, True),  # 65 MiB free
    (100 * MIB, 49 * MIB, True),  # under 64 MiB free, but more than half the file
    (100 * MIB, 50 * MIB, False),  # half exactly
    (2 * MIB, MIB // 2, True),  # 1.5 MiB free, 75 %: the ratio rule
    (28672, 4096, False),  # a new etcd: 86 % free, but 24 KiB (under RATIO_FLOOR_BYTES)
    (64 * MIB, 64 * MIB, False),  # nothing free
    (0, 0, False),
    (10 * MIB, 11 * MIB, False),  # in use above the size (figures read at different moments)
])
def test_when_to_defragment(size, in_use, want):
    assert should_defragment(size, in_use, min_free_bytes=64 * MIB, min_free_ratio=0.5) is want


def test_the_thresholds_are_the_callers():
    assert should_defragment(10 * MIB, 9 * MIB, min_free_bytes=0)  # any free page, with 0
    assert not should_defragment(100 * MIB, 10 * MIB, min_free_bytes=MIB << 10, min_free_ratio=1.0)  # ratio off
    assert should_defragment(4 * RATIO_FLOOR_BYTES, 2 * RATIO_FLOOR_BYTES, min_free_bytes=MIB << 10,
                             min_free_ratio=0.25)


def test_the_defragmenter_applies_its_thresholds_and_renews_its_leadership_often():
    store = EtcdStore("127.0.0.1:1")
    d = Defragmenter(store, 3600, min_free_bytes=64 * MIB, min_free_ratio=0.5)
    assert d.tick_s == 30 and d.needs(MemberStatus(1, "m0", "h:1", 200 * MIB, 100 * MIB, True))
    assert not d.needs(MemberStatus(1, "m0", "h:1", 200 * MIB, 150 * MIB, True))
    assert Defragmenter(store, 0.5).tick_s == 0.5  # never less often than the interval
    with pytest.raises(ValueError, match="0 disables"):
        Defragmenter(store, 0)


def test_the_flags_and_their_defaults():
    cfg = load(RegistryConfig, [])
    assert (cfg.etcd_defrag_interval_s, cfg.etcd_defrag_min_free_mb, cfg.etcd_defrag_min_free_ratio,
            cfg.etcd_defrag_timeout_s) == (3600, 64, 0.5, 60)
    cfg = load(RegistryConfig, ["--etcd-defrag-interval-s", "0", "--etcd-defrag-min-free-mb", "16"])
    assert (cfg.etcd_defrag_interval_s, cfg.etcd_defrag_min_free_mb) == (0, 16)
    env = from_namespace(RegistryConfig, None, {"KVSHUTTLE_REGISTRY_ETCD_DEFRAG_INTERVAL_S": "600",
                                                "KVSHUTTLE_REGISTRY_ETCD_DEFRAG_TIMEOUT_S": "120"})
    assert (env.etcd_defrag_interval_s, env.etcd_defrag_timeout_s) == (600, 120)
    for name, bad in (("interval_s", "-1"), ("min_free_mb", "-1"), ("min_free_ratio", "0"),
                      ("min_free_ratio", "1.5"), ("timeout_s", "0")):
        with pytest.raises(ConfigError, match=f"--etcd-defrag-{name.replace('_', '-')}"):
            from_namespace(RegistryConfig, None, {f"KVSHUTTLE_REGISTRY_ETCD_DEFRAG_{name.upper()}": bad})


def test_member_urls_to_endpoints():
    assert _host_port("http://10.0.0.1:2379") == "10.0.0.1:2379"
    assert _host_port("https://etcd-0.etcd-peers.ns.svc:2379") == "etcd-0.etcd-peers.ns.svc:2379"
    assert _host_port("http://etcd-0") == "etcd-0:2379"
    assert _host_port("http://[fd00::1]:2379") == "[fd00::1]:2379"
    assert _host_port("unix://etcd.sock:0") is None
    assert _host_port("127.0.0.1:2379") == "127.0.0.1:2379"
