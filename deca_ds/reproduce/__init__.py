"""Reproducing the paper's accuracy results: a grid file of tasks x methods x settings x seeds (grid),
each cell run and recorded (cells), the tables (tables, paired) written with the JSON (report), the
paper's published numbers beside them (paper), the loss figures (figures), the answers and judge's
grades of generation cells (generation), and the small pretrained Llama of the scaled protocol
(pretrain)."""

from .cells import check_finished, run_grid
from .figures import write_figures
from .grid import METHODS, Cell, Grid, GridError, build_grid, load_grid
from .pretrain import PretrainOptions, pretrain
from .report import recorded_results, write_report

__all__ = ["METHODS", "Cell", "Grid", "GridError", "PretrainOptions", "build_grid", "check_finished", "load_grid",
           "pretrain", "recorded_results", "run_grid", "write_figures", "write_report"]
