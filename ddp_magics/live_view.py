"""The live view: an HTML widget that shows a running magic's progress, then goes away."""

from __future__ import annotations

from IPython.display import clear_output, display

WIDGET_MIMETYPE = "application/vnd.jupyter.widget-view+json"


class LiveView:
    """An HTML widget shown while a magic runs, then cleared.

    It is displayed with the widget mimetype alone, so tools that compare outputs
    (nbval skips that mimetype) see nothing of it; frontends clear it when the
    magic's final output arrives.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._widget = None

    def update(self, html: str) -> None:
        if not self.enabled:
            return
        if self._widget is None:
            import ipywidgets

            self._widget = ipywidgets.HTML(value=html)
            display(
                {
                    WIDGET_MIMETYPE: {
                        "model_id": self._widget.model_id,
                        "version_major": 2,
                        "version_minor": 0,
                    }
                },
                raw=True,
            )
        else:
            self._widget.value = html

    def close(self) -> None:
        if self._widget is None:
            return
        clear_output(wait=True)
        self._widget.close()
        self._widget = None
