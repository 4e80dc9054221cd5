"""Write shardload/models/hf_tp_plans.json: every TP plan the installed transformers declares.

For each model type whose config class has a ``base_model_tp_plan``: that plan, its
``base_model_ep_plan``, and what the model class ``from_pretrained`` builds adds (``_tp_plan``:
``lm_head``; ``base_model_prefix``; ``_tied_weights_keys``). shardload reads the table when
transformers is not installed; tests/test_hf_tp_tables.py checks it against the installed transformers.

    python scripts/gen_hf_tp_plans.py            # rewrite the table
    python scripts/gen_hf_tp_plans.py --check    # exit 1 if the table is out of date
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

from shardload.models.hf_tp_tables import TABLE_FILE, model_class_entry, transformers_entry

TABLE = Path(__file__).resolve().parent.parent / "shardload" / "models" / TABLE_FILE


def build_table() -> dict[str, Any]:
    """The table from the installed transformers: ``{"transformers": version, "models": {model_type: entry}}``."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import CONFIG_MAPPING

    models = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        entry = transformers_entry(model_type)
        if entry is not None and "model_class" not in entry:
            found = sub_config_model_class(CONFIG_MAPPING[model_type])
            if found is not None:
                entry = {**entry, **model_class_entry(found)}
        if entry is not None:
            models[model_type] = entry
    return {"transformers": version("transformers"), "models": models}


def sub_config_model_class(config_cls: type) -> type | None:
    """The model class of a sub-config no auto mapping lists (a multimodal model's text part): in its modeling
    module, the causal LM built from it, else its base model."""
    module_name = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, RuntimeError):
        return None
    found = [
        c for c in vars(module).values()
        if isinstance(c, type) and getattr(c, "config_class", None) is config_cls
        and not c.__name__.endswith("PreTrainedModel")
    ]  # fmt: skip
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    return found[0] if found else None


def render(table: dict[str, Any]) -> str:
    """The table as written to disk (stable: sorted model types, plans in transformers' order)."""
    return json.dumps(table, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the shipped table instead of writing it")
    args = parser.parse_args(argv)
    text = render(build_table())
    if args.check:
        if TABLE.read_text(encoding="utf-8") != text:
            print(f"{TABLE} is out of date: run python scripts/gen_hf_tp_plans.py", file=sys.stderr)
            return 1
        print(f"{TABLE}: up to date")
        return 0
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE}: {len(json.loads(text)['models'])} model types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
