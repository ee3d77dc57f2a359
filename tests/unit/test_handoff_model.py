"""The handoff message's one model (tierckpt_core.handoff), as both sides read and write it."""

from __future__ import annotations

import json

import pytest

from tierckpt_core.errors import ProtocolError, StepNotFoundError
from tierckpt_core.handoff import HandoffAnswer, HandoffRequest


def test_a_request_reads_back_as_written() -> None:
    req = HandoffRequest("127.0.0.1:7000", "job", 7, "a1", "rank_0.distcp", 0, 10)
    line = req.line()
    assert line.endswith(b"\n") and json.loads(line)["file"] == "rank_0.distcp"
    assert HandoffRequest.from_line(line) == req


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"file": "../../etc/passwd"}, "file name"),
        ({"attempt": "x\r\nHost: evil"}, "attempt"),
        ({"start": 5, "stop": 5}, "bad range"),
        ({"stop": "all"}, "must be integers"),
        ({"start": True}, "must be integers"),
        ({"peer": 7}, "host:port"),
    ],
)
def test_a_bad_request_is_refused_naming_what_is_wrong(
    change: dict[str, object], message: str
) -> None:
    doc = {**json.loads(HandoffRequest("p:1", "job", 7, "a1", "f", 0, 10).line()), **change}
    with pytest.raises(ProtocolError, match="handoff request") as e:
        HandoffRequest.from_line(json.dumps(doc).encode() + b"\n")
    assert message in str(e.value)


def test_a_line_that_is_not_a_json_object_is_refused() -> None:
    for line in (b"GET / HTTP/1.1\r\n\r\n\n", b"[1, 2]\n"):
        with pytest.raises(ProtocolError, match="handoff request: not"):
            HandoffRequest.from_line(line)


def test_answers_carry_ok_or_the_error_by_its_code() -> None:
    assert json.loads(HandoffAnswer(True).line()) == {"ok": True}
    assert HandoffAnswer.from_line(HandoffAnswer(True).line(), "sock").error() is None
    failed = HandoffAnswer.failed(StepNotFoundError("job/step 8: not held"))
    assert json.loads(failed.line()) == {
        "ok": False,
        "code": "step_not_found",
        "detail": "job/step 8: not held",
    }
    err = HandoffAnswer.from_line(failed.line(), "sock").error()
    assert isinstance(err, StepNotFoundError) and str(err) == "job/step 8: not held"
    with pytest.raises(ProtocolError, match="sock: the daemon's answer: not JSON"):
        HandoffAnswer.from_line(b"nope\n", "sock")
