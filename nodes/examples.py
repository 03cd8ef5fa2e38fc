"""Put the example inputs the shipped workflows name into ComfyUI's input folder, and list the templates in order.

LoadImage, LoadImageMask and LoadVideo offer the files of ComfyUI's input directory, so a template
that names `wanvace_example_first.png` only opens cleanly where that file is there. When the pack
loads, every file of `example_inputs/` that the input directory lacks is copied in. A file the user
already has under the same name is never touched, and a failure (read-only folder, full disk) is
logged as a warning: it must never keep the nodes from loading.

No ComfyUI import at module level, so tests can load this file on its own.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

LOG = logging.getLogger(__name__)
EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "example_inputs"

_installed = False


def copy_missing_examples(input_dir: Path | str, source_dir: Path | str = EXAMPLE_DIR) -> list[str]:
    """Copy each file of source_dir that input_dir does not hold; return the names copied.

    Existing entries (files, folders, links) are left alone: the target is created with O_EXCL, so
    a file that appears between the check and the copy is not overwritten either. A copy that fails
    halfway is removed. Errors are logged as warnings, per file, and never raised.
    """
    input_dir, source_dir = Path(input_dir), Path(source_dir)
    try:
        sources = sorted(p for p in source_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError as exc:
        LOG.warning("WanVACE: cannot read the example inputs in %s: %s", source_dir, exc)
        return []
    try:
        input_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        LOG.warning("WanVACE: cannot create ComfyUI's input folder %s (%s); example inputs not copied", input_dir, exc)
        return []
    copied = []
    for source in sources:
        target = input_dir / source.name
        if os.path.lexists(target):
            continue
        try:
            data = source.read_bytes()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            LOG.warning("WanVACE: cannot copy example input %s to %s: %s", source.name, input_dir, exc)
            continue
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        except OSError as exc:
            LOG.warning("WanVACE: cannot copy example input %s to %s: %s", source.name, input_dir, exc)
            try:
                target.unlink()
            except OSError:
                pass
            continue
        copied.append(source.name)
    if copied:
        LOG.info("WanVACE: copied example inputs into %s: %s", input_dir, ", ".join(copied))
    return copied


def install_example_inputs() -> list[str]:
    """Copy the missing example inputs into ComfyUI's input directory, once per process."""
    global _installed
    if _installed:
        return []
    _installed = True
    try:
        import folder_paths

        input_dir = folder_paths.get_input_directory()
    except Exception as exc:  # whatever ComfyUI raises, the pack must still load
        LOG.warning("WanVACE: no ComfyUI input directory (%s); example inputs not copied", exc)
        return []
    return copy_missing_examples(input_dir)


# --- the order of the pack's templates -------------------------------------------------------------------------------

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "example_workflows"
_TEMPLATE_LIST_PATHS = ("/workflow_templates", "/api/workflow_templates")
_order_installed = False


def ordered_template_list(listed: dict, ours: set[str]) -> dict:
    """ComfyUI's `/workflow_templates` answer with this pack's entry (the one that lists exactly our templates)
    sorted by name. The names start with their place ("01 Text to Video", ...); ComfyUI 0.3.75 and 0.33 list a pack's
    files in file-system order, and the frontends (1.32, 1.49) show them in the order listed."""
    return {
        module: sorted(names) if isinstance(names, list) and set(names) == ours else names
        for module, names in listed.items()
    }


def install_template_order() -> None:
    """Have ComfyUI's server list this pack's templates in their order (an aiohttp middleware on that one route)."""
    global _order_installed
    if _order_installed:
        return
    _order_installed = True
    try:
        from aiohttp import web
        from server import PromptServer

        app = PromptServer.instance.app
    except (ImportError, AttributeError) as exc:  # no server (a script or a test)
        LOG.warning("WanVACE: templates left in ComfyUI's order (%s)", exc)
        return
    ours = {p.stem for p in TEMPLATE_DIR.glob("*.json")}

    @web.middleware
    async def templates_in_order(request, handler):
        response = await handler(request)
        if request.method != "GET" or request.path not in _TEMPLATE_LIST_PATHS or response.status != 200:
            return response
        try:
            listed = json.loads(response.text)
        except (AttributeError, TypeError, ValueError):
            return response
        return web.json_response(ordered_template_list(listed, ours))

    try:
        app.middlewares.append(templates_in_order)
    except RuntimeError as exc:  # the server already listens: its middlewares are frozen
        LOG.warning("WanVACE: templates left in ComfyUI's order (%s)", exc)
