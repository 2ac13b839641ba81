"""The tokens a step sampled, for the entries of the next step that refer to them (overlap
scheduling: the router sends step N+1 before step N's tokens are back).

An entry with `sampled_in_task = N` means: "your first token is the one rank 0 sampled for this
request in task N" (N must be the task applied just before). Before the task is converted and
run, every rank writes that token into the entry, so the executor sees an ordinary entry:
- rank 0 takes it from its own result of task N;
- the other ranks get it from rank 0 by one broadcast of the task's referred tokens (a few ints;
  only in tasks that refer to any). Only rank 0 has the logits and samples (with its random
  state and constraint matchers), so the alternatives cost more: every rank sampling would
  need the full logits and identical random state everywhere, and routing the tokens through
  the router would put its round trip back between the steps.
Which requests sampled in the last applied task follows from the tasks alone, so every rank
reaches the same verdict on a reference before the collective (see `executor`: a malformed task
is refused on every rank without entering one).
"""

from __future__ import annotations

from radixserve.v1 import worker_pb2
from worker_service.distributed import TPGroup, broadcast_ids
from worker_service.executor import entry_name


class BadReference(ValueError):
    """An entry refers to a token this rank's last applied task did not sample."""


class SampledTokens:
    """One rank's memory of the last applied task's samples. Used on the task thread only."""

    def __init__(self, group: TPGroup, device: str) -> None:
        self._group = group
        self._device = device
        self._task_id = 0
        self._sampled_ids: frozenset[str] = frozenset()
        self._tokens: dict[str, int] = {}  # rank 0 only

    def resolve(self, task: worker_pb2.DecodeTask) -> int:
        """Write every referred token into its entry, in place; returns how many. Raises
        `BadReference` (on every rank alike, before any collective)."""
        refers, request_ids = [], []
        task_id, sampled_ids, reset = self._task_id, self._sampled_ids, task.reset
        for index, entry in enumerate(task.entries):
            referred = entry.sampled_in_task
            if not referred:
                continue
            request_id = entry.request_id
            if reset or entry.HasField("new_request"):
                raise BadReference(f"{entry_name(index, request_id)}: a request's first entry cannot refer to a "
                                   "sampled token")
            if referred != task_id:
                raise BadReference(
                    f"{entry_name(index, request_id)}: refers to task {referred}, but the last task applied "
                    f"is {task_id}"
                )
            if request_id not in sampled_ids:
                raise BadReference(f"{entry_name(index, request_id)}: task {task_id} sampled no token for it")
            refers.append(entry)
            request_ids.append(request_id)
        if not refers:
            return 0
        if self._group.is_first:
            token_ids = [self._tokens[request_id] for request_id in request_ids]
        else:
            token_ids = [0] * len(refers)
        token_ids = broadcast_ids(token_ids, self._group, self._device)
        for entry, token_id in zip(refers, token_ids):
            entry.token_ids.insert(0, token_id)
            entry.sampled_in_task = 0
        return len(refers)

    def record(self, task: worker_pb2.DecodeTask, result: worker_pb2.TaskResult) -> None:
        """After `task` ran: remember what it sampled (nothing changes if it was refused)."""
        if result.HasField("error"):
            return
        self._task_id = task.task_id
        self._sampled_ids = frozenset(entry.request_id for entry in task.entries if entry.sample)
        if self._group.is_first:
            self._tokens = {token.request_id: token.token_id for token in result.tokens}
