"""The shipped workflows, one per VACE task and a few variants, as graphs built from this package's nodes and ComfyUI's
core nodes: the source of `example_workflows/`.

`scripts/make_workflows.py` writes them to `example_workflows/api/wanvace_<name>.json` (API format) and
`example_workflows/<title>.json` (the graph editor's UI format, with the layout hints, groups, note, graph-editor-only
nodes and model download metadata built here). The pack itself reads only the written files (the videos API starts
from the API twins); `scripts/demo.py` and the tests import this package, and `for_tiny_model` shrinks a workflow to
the tiny test model so it runs in seconds on a CPU.

- `catalog.py`: the workflows' names, tasks and variants, titles, prompts, sizes, example inputs, the model and LoRA
  files they name, the variants' sampling presets;
- `build.py`: each workflow's nodes, step by step, and its `UiLayout`;
- `notes.py`: the Markdown note beside each workflow in the graph editor;
- `tiny.py`: `for_tiny_model`.

Width, height and length are set once per workflow in the graph editor: three of the frontend's primitive nodes
(group "Video size") feed every node input that takes them. The frontend resolves a primitive into the value of
each input it feeds when it queues the prompt, so the API twins carry them as plain constants on those nodes, which
is what ComfyUI's queue-time validation sees.

Standard library only at import: `scripts/demo.sh` reads the task names with the system Python before any set-up.
"""

from .build import GROUP_COLORS, UiLayout, UiNode, build_api_workflow, build_ui_layout
from .catalog import (
    EXAMPLE_INPUTS,
    EXTENSION_GIVEN_FRAMES,
    FP8_VARIANT,
    LIGHTNING_NAG,
    LIGHTNING_SAMPLING,
    LIGHTNING_VARIANT,
    LONG_VARIANT,
    LORA_FILES,
    MODEL_FILES,
    REAL_MODEL,
    SINGLE_FILES,
    TASKS,
    TINY_MODEL,
    WORKFLOW_TITLES,
    WORKFLOWS,
    ModelFile,
    loader_class,
    task_of,
    variant_of,
)
from .tiny import for_tiny_model

__all__ = [
    "EXAMPLE_INPUTS",
    "EXTENSION_GIVEN_FRAMES",
    "FP8_VARIANT",
    "GROUP_COLORS",
    "LIGHTNING_NAG",
    "LIGHTNING_SAMPLING",
    "LIGHTNING_VARIANT",
    "LONG_VARIANT",
    "LORA_FILES",
    "MODEL_FILES",
    "REAL_MODEL",
    "SINGLE_FILES",
    "TASKS",
    "TINY_MODEL",
    "WORKFLOWS",
    "WORKFLOW_TITLES",
    "ModelFile",
    "UiLayout",
    "UiNode",
    "build_api_workflow",
    "build_ui_layout",
    "for_tiny_model",
    "loader_class",
    "task_of",
    "variant_of",
]
