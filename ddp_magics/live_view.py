"""The live view: an HTML widget that shows a running magic's progress, then goes away."""

from __future__ import annotations

from IPython.display import display

WIDGET_MIMETYPE = "application/vnd.jupyter.widget-view+json"


def _widget_view(model_id: str) -> dict:
    return {WIDGET_MIMETYPE: {"model_id": model_id, "version_major": 2, "version_minor": 0}}


class LiveView:
    """An HTML widget shown while a magic runs, then hidden.

    It is displayed with the widget mimetype alone, so tools that compare outputs (nbval skips
    that mimetype) see nothing of it. As the magic ends, its display is updated in place to a
    view of no model (``model_id`` empty), which JupyterLab's widget renderer hides, now and when
    the notebook is opened again; the other outputs of the cell (a pdb dialogue printed while it
    ran) stay where they are, as no ``clear_output`` is sent.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._widget = None
        self._display = None

    def update(self, html: str) -> None:
        if not self.enabled:
            return
        if self._widget is None:
            import ipywidgets

            self._widget = ipywidgets.HTML(value=html)
            self._display = display(_widget_view(self._widget.model_id), raw=True, display_id=True)
        else:
            self._widget.value = html

    def close(self) -> None:
        if self._widget is None:
            return
        self._widget.close()  # its views go first, then the display shows no model
        self._display.update(_widget_view(""), raw=True)
        self._widget = None
