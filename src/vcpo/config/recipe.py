"""``recipe``: the method a config gets for the keys it leaves out.

``stable`` (the default) is the configuration the staleness studies found best or within noise of the best at every
setting and staleness measured, each arm at its own learning rate (benchmarks/RESULTS.md, "What should I use under
staleness?"): VESPO's kernel under VCPO's two controls, the OPOB baseline weighted by the gradient norm alone
(``grad_only``, with the logit proxy for the norm) and the ESS-scaled learning rate. ``paper`` is VCPO exactly as
arXiv 2602.17616 writes it: sequence TIS in REINFORCE form (cap 8), the plug-in OPOB baseline with per-trajectory
gradient norms, the ESS-scaled learning rate.

A recipe fills only the keys a config does not set, so any key written in the file or on the command line wins, and
a saved run's config.yaml (every key written) reloads to the same run whatever the default recipe is.
"""

from __future__ import annotations

from typing import Any, Literal

Recipe = Literal["stable", "paper"]

RECIPES: dict[str, dict[str, Any]] = {
    "stable": {"objective.name": "vespo", "advantage.estimator": "opob", "advantage.opob_variant": "grad_only",
               "advantage.grad_norm_method": "logit_proxy", "trainer.ess_lr.enabled": True},
    "paper": {"objective.name": "vcpo", "advantage.estimator": "opob", "advantage.opob_variant": "plugin",
              "advantage.grad_norm_method": "fast", "trainer.ess_lr.enabled": True},
}
"""Each recipe's keys: the dotted key and the value it takes when the config leaves it out."""

DEFAULT_RECIPE: Recipe = "stable"


def recipe_of(tree: dict[str, Any]) -> str:
    """The recipe a raw config tree names (the default when it names none); an unknown name is left to validation."""
    name = tree.get("recipe", DEFAULT_RECIPE)
    return name if name in RECIPES else DEFAULT_RECIPE


def recipe_default(tree: dict[str, Any], dotted: str) -> Any:
    """The value ``dotted`` takes from the tree's recipe when the tree leaves it out; None if no recipe sets it."""
    return RECIPES[recipe_of(tree)].get(dotted)


def fill_recipe(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of the raw tree with the recipe's keys filled in where the tree leaves them out. A section given as a
    built model (not a mapping) is taken as written."""
    out = dict(tree)
    for dotted, value in RECIPES[recipe_of(tree)].items():
        node = out
        *sections, leaf = dotted.split(".")
        for name in sections:
            child = node.get(name)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                break
            node[name] = child = dict(child)
            node = child
        else:
            node.setdefault(leaf, value)
    return out
