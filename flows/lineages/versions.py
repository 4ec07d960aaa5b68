"""A lineage's model versions and its champion: the promotion decisions recorded on versions (with their eval
results), the gate's baselines (the champion as the alias points now, the lineage's best), and every move of the
alias (by a run, by ``rlflow promote``, by ``rlflow rollback``), appended to the registered model's history.

A run's decision is written on its version (``rlflow.decision``) before anything acts on it, and acting on it
(``apply_decision``) can be repeated: an attempt that dies half way through leaves a decision that the run's next
attempt finishes instead of gating again, so a version is never decided twice, the alias never moves twice for it
and the history never holds a move twice. The history is append-only: one tag per move (``rlflow.champion_move.*``),
so two writers at once (a run's promotion and ``rlflow promote``) never erase each other's entry."""

from __future__ import annotations

import json
import tempfile
import uuid
from datetime import datetime, timezone

from flows.lineages.lineage import ModelReferenceError, champion_version

# on a model version: mean, n, fingerprint, results (an artifact path), run (the run holding it, when not the
# version's own: a later run that re-evaluated the version)
EVAL_TAG = "rlflow.eval.{set}.{field}"


DECISION_TAG = "rlflow.decision"  # on a version: its run's decision, written before anything acts on it


def decide(
    client, name: str, version: str, alias: str, decision, how: str, compared_with: str | None, description: str
) -> dict:
    """Write the run's decision on ``version`` (``rlflow.decision``, after its ``description``) and return it:
    promote or not, why, how it was decided, the champion it was compared with (the alias may move only from
    there) and, when it promotes, the history entry its move will append (made once here, so every attempt
    appends the same one)."""
    client.update_model_version(name, version, description=description)
    reason = decision.reason[:REASON_LIMIT]
    record = {"promote": decision.promote, "reason": reason, "how": how, "champion": compared_with}
    if decision.promote:
        record["move"] = history_entry(alias, version, compared_with, how, reason)
    client.set_model_version_tag(name, version, DECISION_TAG, json.dumps(record))
    return record


def recorded_decision(client, name: str, version: str) -> dict | None:
    """The decision an earlier attempt of the version's run wrote (``decide``), or None."""
    tags = client.get_model_version(name, version).tags or {}
    return json.loads(tags[DECISION_TAG]) if DECISION_TAG in tags else None


def apply_decision(client, name: str, version: str, alias: str, record: dict, results: dict) -> dict:
    """Act on a recorded decision; repeating it changes nothing. Tags ``version`` with its eval results and the
    decision, and moves ``alias`` to it when the decision promotes, only while the alias still
    points at the champion the decision was made against (compare-and-set): when someone moved it meanwhile (``rlflow
    promote`` or ``rollback`` during a long approval), the version is not promoted, and says why. Returns the
    decision as it stands (``promoted``, ``reason``). (The description was written with the decision.)"""
    for result in results.values():
        tag_results(client, name, version, result)
    if record["promote"]:
        move = record["move"]
        if move["key"] not in moves(client, name):  # an earlier attempt may have moved the alias already
            current = champion_version(client, name, alias)
            now = current.version if current is not None else None
            if now not in (version, record["champion"]):
                moved = f"v{record['champion']}" if record["champion"] else "no champion"
                record = {
                    **record,
                    "promote": False,
                    "reason": f"not promoted: @{alias} moved from {moved} to v{now} after this version was gated "
                    f"against it ({record['reason'][:1000]}); `rlflow promote` it if it should still win",
                }
                client.set_model_version_tag(name, version, DECISION_TAG, json.dumps(record))
                client.set_model_version_tag(name, version, "rejected", record["reason"])
                return {"promoted": False, "reason": record["reason"]}
            client.set_registered_model_alias(name, alias, str(version))
            append_move(client, name, move)
        client.set_model_version_tag(name, version, "rlflow.promoted", record["reason"])  # last: it was champion
    else:
        client.set_model_version_tag(name, version, "rejected", record["reason"])
    return {"promoted": record["promote"], "reason": record["reason"]}


def tag_results(client, name: str, version: str, result, run_id: str | None = None) -> None:
    """Point ``version``'s eval tags of ``result.set`` at ``result`` (its MLflow table ``eval/<set>/<label>.json``,
    in ``run_id`` when another run than the version's own made it)."""
    fields = {
        "mean": f"{result.mean:.6g}",
        "n": str(len(result.rows)),
        "fingerprint": result.fingerprint,
        "results": f"eval/{result.set}/{result.label}.json",
    }
    if run_id:
        fields["run"] = run_id
    for field, value in fields.items():
        client.set_model_version_tag(name, version, EVAL_TAG.format(set=result.set, field=field), value)


def version_results(client, version, set_name: str, fingerprint: str):
    """A registered version's final results on ``set_name``, read from the MLflow table its eval tags point at (in
    the run its ``run`` tag names, a later run that re-evaluated it, else in the version's own run); ``None`` when
    it has none made with ``fingerprint`` (other examples or settings), or no run holds them (a version registered
    without a run and never re-evaluated)."""
    from flows.lineages.evaluation import results_from_table

    tags = version.tags or {}
    if tags.get(EVAL_TAG.format(set=set_name, field="fingerprint")) != fingerprint:
        return None
    run_id = tags.get(EVAL_TAG.format(set=set_name, field="run")) or version.run_id
    if not run_id:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = client.download_artifacts(run_id, tags[EVAL_TAG.format(set=set_name, field="results")], folder)
        with open(path) as f:
            table = json.load(f)
    return results_from_table(table, set_name, "final", fingerprint, f"models:/{version.name}/{version.version}")


def gate_baselines(client, name: str, alias: str, candidate, start, started_from: str, reevaluate=None):
    """What the gate compares ``candidate`` (final ``EvalResults``) with: the champion as it is now, as (label,
    results or ``None``), and the lineage's best version when it is not the champion and scored higher, as (label,
    results); ``None`` where there is none. A run that started from the current champion has the champion's
    results already: its ``start`` results (same run, same machine); else the champion's own logged results when
    they were made with the candidate's settings, else ``reevaluate(champion version)``'s, when given."""
    champion = champion_version(client, name, alias)
    if champion is None:
        return None, None
    if started_from == f"models:/{name}/{champion.version}" and start is not None:
        champion_results = start
    else:
        champion_results = version_results(client, champion, candidate.set, candidate.fingerprint)
        if champion_results is None and reevaluate is not None:
            champion_results = reevaluate(champion)
    best = best_version(client, name, candidate.set, candidate.fingerprint, exclude=champion.version)
    mean_tag = EVAL_TAG.format(set=candidate.set, field="mean")
    if best is None or (champion_results is not None and float(best.tags[mean_tag]) <= champion_results.mean):
        return (f"champion v{champion.version}", champion_results), None
    best_results = version_results(client, best, candidate.set, candidate.fingerprint)
    return (f"champion v{champion.version}", champion_results), (f"the lineage's best, v{best.version}", best_results)


def best_version(client, name: str, set_name: str, fingerprint: str, exclude: str | None):
    """The lineage's version with the highest mean on ``set_name`` (same fingerprint) among those that were
    champion and not rolled back, other than ``exclude``; ``None`` when there is none."""
    mean_tag = EVAL_TAG.format(set=set_name, field="mean")
    candidates = [
        v
        for v in client.search_model_versions(f"name = '{name}'")
        if v.version != exclude
        and "rlflow.promoted" in (v.tags or {})
        and "rlflow.rolled_back" not in (v.tags or {})
        and (v.tags or {}).get(EVAL_TAG.format(set=set_name, field="fingerprint")) == fingerprint
        and mean_tag in v.tags
    ]
    return max(candidates, key=lambda v: float(v.tags[mean_tag]), default=None)


CHAMPION_HISTORY_TAG = "rlflow.champion_history"  # the history before it was one tag per move (still read)
MOVE_TAG = "rlflow.champion_move."  # + key: one tag per move of the alias, on the registered model
REASON_LIMIT = 2000  # of a decision's reason in a tag (MLflow's limit on a tag's value is 5000 characters)


def history_entry(alias: str, version: str, previous: str | None, how: str, reason: str) -> dict:
    """One move of ``alias``: to ``version`` from ``previous``, when, how and why; ``key`` names its tag (the time
    first, so the tags sort in the order of the moves)."""
    at = datetime.now(timezone.utc)
    return {
        "key": f"{at:%Y%m%dT%H%M%S%fZ}-v{version}-{uuid.uuid4().hex[:6]}",
        "at": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "alias": alias,
        "version": str(version),
        "previous": previous,
        "how": how,
        "reason": reason[:REASON_LIMIT],
    }


def append_move(client, name: str, entry: dict) -> None:
    client.set_registered_model_tag(name, MOVE_TAG + entry["key"], json.dumps(entry))


def moves(client, name: str) -> dict[str, dict]:
    """key -> entry of every move in the registered model's history (one tag each)."""
    tags = client.get_registered_model(name).tags or {}
    return {key[len(MOVE_TAG) :]: json.loads(value) for key, value in tags.items() if key.startswith(MOVE_TAG)}


def move_champion(client, name: str, alias: str, version: str, how: str, reason: str) -> dict:
    """Point ``alias`` at ``version`` and append the move to the registered model's champion history (``rlflow
    promote`` and ``rlflow rollback``; a run's promotion goes through ``apply_decision``). Returns the entry."""
    previous = champion_version(client, name, alias)
    entry = history_entry(alias, version, previous.version if previous is not None else None, how, reason)
    client.set_registered_model_alias(name, alias, str(version))
    append_move(client, name, entry)
    return entry


def champion_history(client, name: str) -> list[dict]:
    """Every move of the lineage's alias, oldest first (empty for a model registered before the history existed)."""
    tags = client.get_registered_model(name).tags or {}
    before = json.loads(tags.get(CHAMPION_HISTORY_TAG, "[]"))  # kept by rlflow before one tag per move
    return before + [{k: v for k, v in entry.items() if k != "key"} for _, entry in sorted(moves(client, name).items())]


def promote_by_hand(client, name: str, alias: str, version: str, reason: str) -> dict:
    """``rlflow promote``: make ``version`` the champion whatever the gate said, recording who decided why.

    Raises:
        ModelReferenceError: the registered model or the version does not exist.
    """
    _require_version(client, name, version)
    client.set_model_version_tag(name, version, "rlflow.promoted", f"by hand: {reason}")
    return move_champion(client, name, alias, version, "promoted by hand", reason)


def rollback(client, name: str, alias: str, reason: str) -> dict:
    """``rlflow rollback``: move ``alias`` back to the champion before the current one (the newest in the champion
    history that is not the current version and was never rolled back; for a lineage without a history, the newest
    earlier version that was promoted), tagging the version it leaves ``rlflow.rolled_back`` with ``reason``. A
    second rollback goes further back, never forth.

    Raises:
        ModelReferenceError: the lineage has no champion, or no earlier champion to go back to.
    """
    current = champion_version(client, name, alias)
    if current is None:
        raise ModelReferenceError(f"{name} has no @{alias}: nothing to roll back")
    rolled_back = {
        v.version for v in client.search_model_versions(f"name = '{name}'") if "rlflow.rolled_back" in (v.tags or {})
    }
    earlier = [  # the champions before the current one, newest first, from the history
        version
        for move in reversed([m for m in champion_history(client, name) if m["alias"] == alias])
        for version in (move["version"], move["previous"])
        if version and version != current.version and version not in rolled_back
    ]
    if not earlier:  # no history (a lineage from before it was kept): the newest earlier promoted version
        earlier = [
            v.version
            for v in sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: -int(v.version))
            if int(v.version) < int(current.version)
            and "rlflow.promoted" in (v.tags or {})
            and v.version not in rolled_back
        ]
    if not earlier:
        raise ModelReferenceError(
            f"{name}@{alias} is v{current.version}, and no earlier version was champion (or all were rolled back)"
        )
    target = earlier[0]
    client.set_model_version_tag(name, current.version, "rlflow.rolled_back", reason)
    return move_champion(client, name, alias, target, f"rolled back from v{current.version}", reason)


def _require_version(client, name: str, version: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, str(version))
    except MlflowException:
        existing = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise ModelReferenceError(
            f"{name} has no version {version}" + (f"; its versions: {existing}" if existing else " (no such model)")
        ) from None
