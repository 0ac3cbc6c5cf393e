"""The staged-push state machine (vllm/staged_push.py) without an engine: one version staged at a time; a second begin
is refused naming both versions unless it restarts the same version, the open stage's sender is gone, or the stage
was aborted; buckets, commits and aborts of another version name the staged one and leave it intact."""
import pytest

from moe_lora_rl.vllm.staged_push import Staging


def _stage(st, version, n=2, pid=None, served=None):
    return st.begin(version, f"crc-{version}", 4, 8.0, n, served=served, sender_pid=pid)


def test_happy_path_and_commit_closes_stage():
    st = Staging()
    _stage(st, 1)
    st.bucket(1, 0, {"a": 1})
    st.bucket(1, 1, {"b": 2})
    got = st.commit(1)
    assert (got.version, got.checksum, got.tensors) == (1, "crc-1", {"a": 1, "b": 2})
    assert st.version is None
    _stage(st, 2, served=1)                                  # the next push opens freely


def test_second_begin_refused_naming_both_versions():
    st = Staging()
    _stage(st, 5)
    st.bucket(5, 0, {"a": 1})
    with pytest.raises(ValueError, match=r"cannot begin version 6: version 5 is staged.*version 4 stays served"):
        _stage(st, 6, served=4)
    # the refused begin changed nothing: version 5 completes and commits
    st.bucket(5, 1, {"b": 2})
    assert st.commit(5).tensors == {"a": 1, "b": 2}


def test_other_versions_buckets_commit_abort_name_the_staged_one():
    st = Staging()
    _stage(st, 5)
    for call, what in ((lambda: st.bucket(6, 0, {"x": 0}), "bucket 0"), (lambda: st.commit(6), "commit"),
                       (lambda: st.abort(6), "abort")):
        with pytest.raises(ValueError, match=f"{what} of version 6: version 5 is staged"):
            call()
    assert st.version == 5 and st.stage.tensors == {}
    with pytest.raises(ValueError, match="no version is staged"):
        Staging().commit(1)


def test_abort_then_new_version():
    st = Staging()
    _stage(st, 5)
    st.bucket(5, 0, {"a": 1})
    assert st.abort(5) == {"aborted": 5}
    assert _stage(st, 6)["replaced"] is None
    with pytest.raises(ValueError, match="bucket 0 of version 5: version 6 is staged"):
        st.bucket(5, 0, {"a": 1})                           # a late bucket of the aborted push


def test_same_version_restarts():
    st = Staging()
    _stage(st, 5)
    st.bucket(5, 0, {"a": 1})
    assert _stage(st, 5)["replaced"] == 5
    st.bucket(5, 0, {"a": 1})                                # not "repeated": the stage started over
    assert st.stage.buckets == {0: 1}


def test_gone_sender_is_replaced_live_sender_is_not():
    alive = {100: True, 200: False}
    st = Staging(alive=lambda pid: alive[pid])
    _stage(st, 5, pid=100)
    with pytest.raises(ValueError, match="version 5 is staged"):
        _stage(st, 6, pid=300)
    alive[100] = False                                        # the sender of version 5 died mid-push
    assert _stage(st, 6, pid=300)["replaced"] == 5
    st2 = Staging(alive=lambda pid: False)
    _stage(st2, 5)                                           # no pid given: never assumed gone
    with pytest.raises(ValueError, match="version 5 is staged"):
        _stage(st2, 6)


def test_commit_checks():
    st = Staging()
    _stage(st, 1, n=3)
    st.bucket(1, 2, {"c": 3})
    with pytest.raises(ValueError, match=r"buckets \[0, 1\] never arrived"):
        st.commit(1)
    assert st.version is None                                # a failed commit closes the stage
    st.begin(2, None, 4, 8.0, 0)
    with pytest.raises(ValueError, match="no checksum given"):
        st.commit(2)
    st.begin(3, None, 4, 8.0, 0)
    assert st.commit(3, "crc-late").checksum == "crc-late"
    _stage(st, 4)
    with pytest.raises(ValueError, match="repeated or out of range"):
        st.bucket(4, 2, {})
    st.bucket(4, 0, {"a": 1})
    with pytest.raises(ValueError, match="tensors sent twice"):
        st.bucket(4, 1, {"a": 1})
    with pytest.raises(ValueError, match="stale adapter version 4: version 4 is served"):
        _stage(st, 4, served=4)


def test_transport_aborts_its_stage_after_a_failed_bucket():
    """TransportBase.push against a fake engine made of a Staging: a bucket that fails drops the sender's stage, so
    the next push is accepted (without the abort it would be refused: version 1 still staged)."""
    import torch

    from kit.fakes import FakeEngine

    tensors = {"a": torch.zeros(4), "b": torch.zeros(4)}            # 16 bytes each: two buckets
    tr = FakeEngine(bucket_bytes=16, fail_bucket=1)
    with pytest.raises(ValueError, match="bucket lost"):
        tr.push(1, tensors, 4, 8.0)
    assert tr.st.version is None
    tr.fail_bucket = None
    served = tr.push(2, tensors, 4, 8.0).served
    assert served["version"] == 2 and served["versions"] == [2] and served["num_tensors"] == 2, served


def test_staging_next_version_while_pinned_requests_run():
    """pin (vllm/versions.py): version 6 is staged and committed while requests still run on 5; a commit that does
    not fit is refused after the stage closed (the sender pushes again later) and leaves the held versions as they
    were; the wait policy stages the same version again once a version was freed."""
    from moe_lora_rl.vllm.versions import InflightConfig, VersionTable

    table = VersionTable(InflightConfig("pin", 2))
    st = Staging()

    def push(version):
        _stage(st, version, n=1, served=table.newest)              # served: the newest held version
        st.bucket(version, 0, {"a": version})
        st.commit(version)
        return table.admit(version)                                 # the worker's activation

    push(5)
    table.track([["r1", None]])
    assert push(6) == [] and table.held == [5, 6]                   # 5 still runs r1
    table.track([["r2", None]])
    assert not table.can_commit()
    with pytest.raises(ValueError, match=r"cannot commit adapter version 7: max_versions=2"):
        push(7)
    assert st.version is None and table.held == [5, 6]              # stage closed, nothing served changed
    with pytest.raises(ValueError, match="stale adapter version 6: version 6 is served"):
        _stage(st, 6, served=table.newest)
    table.release(["r1"])                                           # 5 freed: the waiting commit fits now
    assert table.held == [6] and table.can_commit()
    assert push(7) == [] and table.held == [6, 7] and table.serving("r2") == 6


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _timed(timeout_s=10.0):
    clock, seen = Clock(), []
    st = Staging(timeout_s=timeout_s, clock=clock, on_expire=lambda stage, idle: seen.append((stage.version, idle)))
    return st, clock, seen


def test_stage_expires_after_timeout_and_not_before():
    st, clock, seen = _timed()
    _stage(st, 5)
    clock.t += 9.9
    assert st.expire() is None and st.version == 5 and st.idle_s() == pytest.approx(9.9)
    clock.t += 0.1
    assert st.expire() == 5 and st.version is None and st.expired == 1
    assert seen == [(5, pytest.approx(10.0))]
    assert st.expire() is None                                # nothing staged: nothing to expire
    assert Staging().expire() is None and Staging().idle_s() is None


def test_buckets_reset_the_clock_and_late_ones_still_land():
    st, clock, seen = _timed()
    _stage(st, 5, n=3)
    for i in range(2):
        clock.t += 8.0
        st.bucket(5, i, {f"t{i}": i})                         # progress: 16 s since begin, never 10 s idle
        assert st.expire() is None
    clock.t += 12.0                                           # idle past the timeout, but not yet expired:
    st.bucket(5, 2, {"t2": 2})                                # the stage is open until the engine aborts it
    assert st.commit(5).tensors == {"t0": 0, "t1": 1, "t2": 2} and seen == []


def test_expired_stage_replaced_by_another_version_fresh_one_refused():
    st, clock, seen = _timed()
    _stage(st, 5)
    st.bucket(5, 0, {"a": 1})
    clock.t += 9.0                                            # negative control: fresh, no pid: still refused
    with pytest.raises(ValueError, match=r"cannot begin version 6: version 5 is staged.*let it expire: 10 s"):
        _stage(st, 6, served=4)
    assert st.version == 5 and st.expired == 0
    clock.t += 1.0
    assert _stage(st, 6, served=4) == {"staging": 6, "replaced": 5}
    assert seen == [(5, pytest.approx(10.0))] and st.expired == 1
    with pytest.raises(ValueError, match="bucket 1 of version 5: version 6 is staged"):
        st.bucket(5, 1, {"b": 2})                             # the dead sender's late bucket
    st.bucket(6, 0, {"a": 1})
    st.bucket(6, 1, {"b": 2})
    assert st.commit(6).version == 6


@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), "600", None, True])
def test_stage_timeout_must_be_a_positive_number(bad):
    from moe_lora_rl.vllm.staged_push import check_stage_timeout

    with pytest.raises(ValueError, match=r"^stage_timeout_s must be > 0, got "):
        Staging(timeout_s=bad)
    with pytest.raises(ValueError, match=r"^--stage-timeout-s must be > 0, got "):
        check_stage_timeout(bad, "--stage-timeout-s")
    assert check_stage_timeout(2) == 2.0 and check_stage_timeout(float("inf")) == float("inf")
