"""Finding nodes in an API-format graph (`{node id: {"class_type": ..., "inputs": ...}}`), as the tests that edit the
shipped workflows before queueing them do."""

from __future__ import annotations


def nodes_of_type(workflow: dict, class_type: str) -> list[dict]:
    return [node for node in workflow.values() if node["class_type"] == class_type]


def node_id_of(workflow: dict, class_type: str) -> str:
    """The id of the one node of `class_type` in `workflow`."""
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return node_id
