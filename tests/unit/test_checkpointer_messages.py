"""The messages ranks exchange while saving and restoring are typed records with a version: one of another
version or kind is refused as `format`, never misread."""
import pytest

from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.errors import PublishFailed
from alpha_ckpt.tiers.durable import messages
from alpha_ckpt.tiers.durable.messages import (Candidate, Candidates, Completion, Descriptor, Interval, Layout, Outcome,
                                         UsageVerdict, Verdict, WriteReport, written_verdict)

RECORDS = [
    Outcome.success(), Outcome(False, "rank 1: disk full"), Outcome(False, "nan", "non-finite"),
    Descriptor(prefix={"run": "r"}, skeleton={"dict": {}}, replicated=["w"], regions=[], pieces=[["w", 0, 4]],
               device="cpu"),
    Descriptor(refused=Outcome(False, "rank 1: bad", "format")),
    Layout(Outcome.success(), state={"dict": {}}, regions=[{"ordinal": 0}], devices=["cpu"], layout=None,
           write_mode="buffered"),
    WriteReport(replicas={"w": "ab"}, shards=[{"digest": "cd"}], failure=["rank 1 could not write", None]),
    Completion(Outcome.success(), "ab" * 32, 3, 1024), Completion.failed(Outcome(False, "fenced", "fenced")),
    Verdict("corrupt-shard", "rank 1: a flipped byte"), UsageVerdict("rank 0: store 's' is a regular file"),
    Interval(7), Interval(None),
    Candidate(root="ab" * 32, devices=["cpu"]), Candidate(refusal=Verdict("foreign-learner", "x"), binding=True),
    Candidates.of([Candidate(root="ab" * 32), Candidate(root="cd" * 32)]),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_reads_back_as_it_was_sent_and_says_its_version(record):
    sent = record.to_json()
    assert sent["v"] == messages.VERSION and sent["kind"] == record.KIND
    assert type(record).from_json(sent) == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_of_another_version_is_refused_as_format(record):
    for version in (None, 0, messages.VERSION + 1):
        sent = {**record.to_json(), "v": version}
        with pytest.raises(Refusal) as refused:
            type(record).from_json(sent)
        assert refused.value.code is RefusalCode.FORMAT


def test_a_record_of_another_kind_or_a_bare_dict_is_refused_as_format():
    for sent in (Interval(3).to_json(), {"ok": True}, None, [1]):
        with pytest.raises(Refusal) as refused:
            Completion.from_json(sent)
        assert refused.value.code is RefusalCode.FORMAT


def test_a_failed_outcome_raises_the_same_refusal_or_publish_failure_on_every_rank():
    with pytest.raises(Refusal) as refused:
        Outcome(False, "rank 1: nan", "non-finite").raise_failure()
    assert refused.value.code is RefusalCode.NON_FINITE
    with pytest.raises(PublishFailed):
        Outcome(False, "rank 0: disk full").raise_failure()
    Outcome.success().raise_failure()  # nothing


def test_the_verdict_on_the_writes_is_the_first_failure_then_a_diverged_replica_then_ok():
    ok = WriteReport(replicas={"w": "aa"})
    assert written_verdict([ok, ok]).ok
    failed = written_verdict([ok, WriteReport(replicas={}, failure=["rank 1: nan", "non-finite"])])
    assert (failed.ok, failed.code) == (False, "non-finite")
    diverged = written_verdict([ok, WriteReport(replicas={"w": "bb"})])
    assert (diverged.ok, diverged.code) == (False, RefusalCode.MIXED_CAPTURE.value)


def _diverged(states) -> Refusal:
    from alpha_ckpt.collective.agreement import merge_skeletons
    from alpha_ckpt.state.capture import capture_state
    with pytest.raises(Refusal) as refused:
        merge_skeletons([capture_state(state, rank, len(states)).skeleton for rank, state in enumerate(states)])
    return refused.value


def test_a_diverged_replicated_value_is_refused_naming_it_and_the_per_rank_option_that_saves_it():
    refusal = _diverged([{"model": {"step": 0, "lr": 0.1}}, {"model": {"step": 1, "lr": 0.1}}])
    assert refusal.code is RefusalCode.MIXED_CAPTURE
    assert 'per_rank=["model.step"]' in refusal.message and "PerRank(" not in refusal.message


def test_a_diverged_replicated_tensor_is_refused_naming_it_and_the_per_rank_option_that_saves_it():
    verdict = written_verdict([WriteReport(replicas={"model.bn.running_mean": "aa"}),
                               WriteReport(replicas={"model.bn.running_mean": "bb"})])
    assert verdict.code == RefusalCode.MIXED_CAPTURE.value
    assert 'per_rank=["model.bn.running_mean"]' in verdict.reason and "PerRank(" not in verdict.reason
