"""What only notebooks use, one module per concern; a notebook reaches all of it through this
package (`from tinygpt import colab`, then `colab.recipe_picker(...)`):

- `runs`: where runs live, Drive, a run's two homes and
  where it stands (`mount`: mounting Drive in Colab)
- `pickers`: the recipe, base and finetuning dropdowns
- `tables`: tables shown as HTML in a notebook and as text elsewhere
- `plots`: the live loss plot (a trainer callback)
- `download`: a run as a zip; `sampling`: text from a run
- `smoke`: smoke mode (`TINYGPT_SMOKE=1`); `notebook`: the kernel, display, ipywidgets on demand
"""

from tinygpt.colab.download import zip_run
from tinygpt.colab.mount import DRIVE_RUNS, in_colab, mount_drive
from tinygpt.colab.notebook import in_notebook
from tinygpt.colab.pickers import (
    base_picker,
    default_hours,
    default_recipe,
    finetune_picker,
    recipe_picker,
)
from tinygpt.colab.plots import LossPlot, plan_plot
from tinygpt.colab.runs import RunFolders, connect_drive, run_folders, run_status, workdir
from tinygpt.colab.sampling import sample_prompt, samples
from tinygpt.colab.smoke import (
    SMOKE_RECIPE,
    SMOKE_TRAIN,
    eval_data,
    smoke_base,
    smoke_data,
    smoke_mode,
    smoke_settings,
)
from tinygpt.colab.tables import (
    Table,
    Tables,
    base_rows,
    hardware_table,
    recipes_table,
    result_table,
    startup_table,
    summary,
    trial_search,
)
from tinygpt.pretrain.init import pretrain_recipe  # sized for the base picked (01_pretrain)

__all__ = [
    "DRIVE_RUNS",
    "SMOKE_RECIPE",
    "SMOKE_TRAIN",
    "LossPlot",
    "RunFolders",
    "Table",
    "Tables",
    "base_picker",
    "base_rows",
    "connect_drive",
    "default_hours",
    "default_recipe",
    "eval_data",
    "finetune_picker",
    "hardware_table",
    "in_colab",
    "in_notebook",
    "mount_drive",
    "plan_plot",
    "pretrain_recipe",
    "recipe_picker",
    "recipes_table",
    "result_table",
    "run_folders",
    "run_status",
    "sample_prompt",
    "samples",
    "smoke_base",
    "smoke_data",
    "smoke_mode",
    "smoke_settings",
    "startup_table",
    "summary",
    "trial_search",
    "workdir",
    "zip_run",
]
