"""A lineage's model versions and its champion: the promotion decisions recorded on versions (with their eval
results), the gate's baselines (the champion as the alias points now, the lineage's best), and every move of the
alias (by a run, by ``rlflow promote``, by ``rlflow rollback``), appended to the registered model's history."""

from __future__ import annotations

import json
import tempfile
from datetime import datetime, timezone

from flows.lineage import ModelReferenceError, champion_version

# on a model version: mean, n, fingerprint, results (an artifact path), run (the run holding it, when not the
# version's own: a later run that re-evaluated the version)
EVAL_TAG = "rlflow.eval.{set}.{field}"


def record_decision(
    client, name: str, version: str, alias: str, decision, results: dict, description: str, how: str
) -> dict:
    """Tag ``version`` with its eval results and the gate's decision, describe it, and move ``alias`` to it when
    the decision promotes. ``results``: set name -> the version's ``EvalResults`` (final). Returns the decision."""
    for result in results.values():
        tag_results(client, name, version, result)
    client.update_model_version(name, version, description=description)
    if decision.hacking:
        client.set_model_version_tag(name, version, "rlflow.reward_hacking", decision.hacking)
    if decision.promote:
        client.set_model_version_tag(name, version, "rlflow.promoted", decision.reason)
        move_champion(client, name, alias, version, how, decision.reason)
    else:
        client.set_model_version_tag(name, version, "rejected", decision.reason)
    return {"promoted": decision.promote, "reason": decision.reason}


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
    from flows.evaluation import results_from_table

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


CHAMPION_HISTORY_TAG = "rlflow.champion_history"  # on the registered model: the alias's moves, oldest first
TAG_VALUE_LIMIT = 5000  # MLflow's limit on a tag's value: the oldest moves are dropped to fit


def move_champion(client, name: str, alias: str, version: str, how: str, reason: str) -> dict:
    """Point ``alias`` at ``version`` and append the move to the registered model's champion history (the one way the
    alias moves: a run's promotion, ``rlflow promote``, ``rlflow rollback``). Returns the history entry."""
    previous = champion_version(client, name, alias)
    client.set_registered_model_alias(name, alias, str(version))
    entry = {
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "alias": alias,
        "version": str(version),
        "previous": previous.version if previous is not None else None,
        "how": how,
        "reason": reason,
    }
    history = champion_history(client, name) + [entry]
    while len(json.dumps(history)) > TAG_VALUE_LIMIT and len(history) > 1:
        history.pop(0)
    client.set_registered_model_tag(name, CHAMPION_HISTORY_TAG, json.dumps(history))
    return entry


def champion_history(client, name: str) -> list[dict]:
    """Every move of the lineage's alias, oldest first (empty for a model registered before the history existed)."""
    tags = client.get_registered_model(name).tags or {}
    return json.loads(tags.get(CHAMPION_HISTORY_TAG, "[]"))


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
