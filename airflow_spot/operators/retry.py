"""How Airflow retries a segment: its own 3.3 ``retry_policy`` (``ExceptionRetryPolicy``) decides per exception.

* :class:`~airflow_spot.operators.segment.SegmentPreempted` (preempted or lost): retry at once. Nothing
  is wrong with the job, the next try resumes from the last committed step on a fresh instance, and
  every second of delay is a second of the job doing nothing. (No capacity anywhere is not a try: the
  segment waits on a timer and decides again, ``SpotSegmentOperator.capacity_recheck_seconds``.) The decision's reason (shown by Airflow
  as the try's retry reason) carries the exception's message: which instance, which step it resumes from.
* :class:`~airflow_spot.operators.segment.SegmentCodeFailure` (the user's command failed): retry after the
  task's own ``retry_delay`` (and its exponential backoff, if set), again with the reason.
* anything else: Airflow's default.

What this cannot express stays in the operator: Airflow's ``retries`` count the tries of one task instance,
but ``max_preemptions`` is a budget of the whole job across its segments, and ``code_retries`` must not be
consumed by preemptions (a segment with ``retries=max_preemptions+code_retries`` would otherwise let a
broken script retry ``max_preemptions`` times). Those budgets raise ``AirflowFailException``, which Airflow
never hands to a retry policy.

A ``retry_policy`` the user gives the segment is not replaced: it is consulted first (its RETRY or FAIL
wins) and this policy decides what it leaves at DEFAULT.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryDecision, RetryPolicy, RetryRule

log = logging.getLogger(__name__)

#: retry reasons are stored on the task instance: keep them short enough for the UI and the column
MAX_REASON_CHARS = 480

PREEMPTED_REASON = "preempted or lost: retrying at once on a fresh instance"
CODE_FAILURE_REASON = "the training command failed: retrying after retry_delay"


class SegmentRetryPolicy(ExceptionRetryPolicy):
    """``ExceptionRetryPolicy`` whose reason also carries the exception's first line (what happened where).

    :param preempted: the exception class of a preempted or lost attempt (retried at once).
    :param code_failure: the exception class of a failed training command (retried after ``retry_delay``).
    """

    def __init__(self, preempted: type[BaseException], code_failure: type[BaseException]) -> None:
        super().__init__(
            rules=[
                RetryRule(exception=preempted, action=RetryAction.RETRY, retry_delay=timedelta(0),
                          reason=PREEMPTED_REASON),
                # No delay of its own: the task's retry_delay (the user's) and its backoff apply.
                RetryRule(exception=code_failure, action=RetryAction.RETRY, reason=CODE_FAILURE_REASON),
            ],
        )

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int, context: Any = None):
        decision = super().evaluate(exception, try_number, max_tries, context)
        if decision.action is RetryAction.DEFAULT:
            return decision
        detail = str(exception).strip().splitlines()[0] if str(exception).strip() else ""
        reason = f"{decision.reason}: {detail}" if detail else decision.reason
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        return RetryDecision(action=decision.action, retry_delay=decision.retry_delay, reason=reason)


class UserFirstRetryPolicy(RetryPolicy):
    """The user's policy first; where it says DEFAULT (no opinion), the segment's policy decides.

    (Airflow 3.3.2 has no chaining policy of its own.) A user policy that raises is logged by Airflow's
    caller only when it propagates, so it is caught here and counts as DEFAULT: a broken user policy must
    not turn a preemption into a failed job.
    """

    def __init__(self, user: RetryPolicy, segment: SegmentRetryPolicy) -> None:
        self.user = user
        self.segment = segment

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int, context: Any = None):
        try:
            decision = self.user.evaluate(exception=exception, try_number=try_number, max_tries=max_tries,
                                          context=context)
        except Exception:  # noqa: BLE001
            log.exception("the user's retry_policy raised; the segment's policy decides instead")
            decision = None
        if isinstance(decision, RetryDecision) and decision.action is not RetryAction.DEFAULT:
            return decision
        return self.segment.evaluate(exception, try_number, max_tries, context)

    def serialize(self) -> dict[str, Any]:
        return {"__type": type(self).__name__, "user": self.user.serialize(), "segment": self.segment.serialize()}


def segment_retry_policy(
    user_policy: Any, preempted: type[BaseException], code_failure: type[BaseException]
) -> RetryPolicy:
    """The segment's policy, composed with the user's own when one is given (the user's is asked first).

    :raises TypeError: when ``user_policy`` is not an Airflow ``RetryPolicy``.
    """
    if isinstance(user_policy, (SegmentRetryPolicy, UserFirstRetryPolicy)):
        return user_policy  # already composed (an operator copied or re-created by Airflow keeps its policy)
    ours = SegmentRetryPolicy(preempted, code_failure)
    if user_policy is None:
        return ours
    if not isinstance(user_policy, RetryPolicy):
        raise TypeError(
            f"retry_policy must be an airflow.sdk RetryPolicy (e.g. ExceptionRetryPolicy(rules=[...])), got "
            f"{user_policy!r}; the segment composes it with its own policy (yours is asked first)"
        )
    return UserFirstRetryPolicy(user_policy, ours)
