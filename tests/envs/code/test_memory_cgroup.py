"""Where the local sandbox makes its runs' memory cgroups: found from /proc/self/cgroup and
mountinfo text (pure), and the cap's arithmetic. The cap itself is tested on real runs in
test_code_sandbox_hostile.py."""

from __future__ import annotations

import os

import pytest

from rftgym.envs.code.memory_cgroup import OVERHEAD_MB, CgroupParent, MemoryGroups, locate, run_cap_mb

V1_CGROUP = "9:name=systemd:/\n8:pids:/\n4:memory:/jobs/abc\n0::/\n"
V1_MOUNTS = ("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
             "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
             "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
V2_MOUNTS = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_v1_memory_hierarchy_is_preferred_where_mounted():
    assert locate(V1_CGROUP, V1_MOUNTS) == CgroupParent("/sys/fs/cgroup/memory/jobs/abc", 1)


def test_cgroup_v2_alone_gives_the_unified_group():
    assert locate("0::/user.slice/job\n", V2_MOUNTS) == CgroupParent("/sys/fs/cgroup/user.slice/job", 2)
    assert locate("0::/\n", V2_MOUNTS) == CgroupParent("/sys/fs/cgroup", 2)


def test_a_mount_of_a_subtree_is_followed_and_one_elsewhere_refused():
    mounts = "35 31 0:32 /jobs /mnt/mem rw - cgroup cgroup rw,memory\n"
    assert locate("4:memory:/jobs/abc\n", mounts) == CgroupParent("/mnt/mem/abc", 1)
    assert locate("4:memory:/jobsx/abc\n", mounts) is None   # a prefix of the name is not the subtree
    assert locate("4:memory:/other\n", mounts) is None


def test_escaped_mount_points_and_missing_hierarchies():
    mounts = r"35 31 0:32 / /sys/fs/my\040cgroups rw - cgroup cgroup rw,memory" + "\n"
    assert locate("4:memory:/a\n", mounts) == CgroupParent("/sys/fs/my cgroups/a", 1)
    assert locate("4:memory:/a\n", "") is None                      # not mounted
    assert locate("8:pids:/\n", V1_MOUNTS) is None                   # no memory controller, no v2 line
    assert locate("garbage\n\n", V1_MOUNTS + "short line\n") is None


def test_the_cap_counts_memory_the_three_tmpfs_and_the_jails_own_processes():
    assert run_cap_mb(128, 8) == 128 + 3 * 8 + OVERHEAD_MB
    assert run_cap_mb(512, 64) - run_cap_mb(256, 64) == 256


def test_groups_of_hosts_that_are_gone_are_removed_and_others_kept(tmp_path):
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    for name in (f"rftgym-{gone}-0", f"rftgym-{os.getpid()}-3", "someone-else", f"rftgym-{gone}-x"):
        (tmp_path / name).mkdir()
    MemoryGroups(CgroupParent(str(tmp_path), 1)).remove_stale()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"rftgym-{os.getpid()}-3", "someone-else",
                                                                  f"rftgym-{gone}-x"])


def test_a_v2_group_without_the_memory_controller_is_refused_and_removed(tmp_path, monkeypatch):
    # A plain directory stands in for a v2 group whose parent does not delegate memory.
    real_mkdir, removed = os.mkdir, []

    def mkdir_with_controllers(path, *args):
        real_mkdir(path, *args)
        with open(os.path.join(path, "cgroup.controllers"), "w") as f:
            f.write("cpu io pids\n")

    monkeypatch.setattr(os, "mkdir", mkdir_with_controllers)
    monkeypatch.setattr(os, "rmdir", removed.append)   # cgroupfs removes a group with its files
    with pytest.raises(OSError, match="memory controller is not enabled for child groups of " + str(tmp_path)):
        MemoryGroups(CgroupParent(str(tmp_path), 2)).new()
    assert removed == [str(next(tmp_path.iterdir()))]


def test_without_bwrap_a_daemon_a_run_leaves_is_killed_with_its_group():
    import uuid

    from rftgym.envs.code.sandbox import Program
    from rftgym.envs.code.sandbox_local import LocalSandbox

    sandbox = LocalSandbox(use_bwrap=False, warm_jails=False)
    try:
        if sandbox.memory_groups is None:
            pytest.skip(f"no memory cgroup can be made here: {sandbox.memory_cap_note}")
        marker = f"rftgym-daemon-{uuid.uuid4().hex}"
        parent, ours = sandbox.memory_groups.parent.path, f"rftgym-{os.getpid()}-"

        def our_groups():   # (other sandboxes of this process, e.g. warm jails, have theirs)
            return {name for name in os.listdir(parent) if name.startswith(ours)}

        before = our_groups()
        daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint('left')\n"
        result = sandbox.run(Program({"main.py": daemon}, argv=("python", "main.py", marker)))
        assert result.ok and result.stdout == "left\n", result
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(pid)
            except OSError:
                pass
        assert alive == []   # it escaped the run's process group, not its cgroup
        assert our_groups() == before   # the run's group is gone
    finally:
        sandbox.close()
