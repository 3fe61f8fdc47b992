// The number of ranks in the notebook's toolbar. Kept in the notebook's metadata (ddp_magics.
// world_size), so a reopened notebook starts the same: it is given to the kernel as
// DistributedMagics.default_world_size, the size %dist_start takes without -n. A change asks
// first, then restarts the cluster at the new size (stop, then start) where one runs.

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { ClusterStates } from './cluster';

export const METADATA_KEY = 'ddp_magics';

export function savedWorldSize(panel: NotebookPanel): number | null {
  const saved: any = panel.context.model.getMetadata(METADATA_KEY);
  const size = saved ? Number(saved.world_size) : NaN;
  return Number.isSafeInteger(size) && size > 0 ? size : null;
}

/** Code that makes ``size`` the kernel's DistributedMagics.default_world_size, loaded or not. */
export function defaultSizeCode(size: number): string {
  return (
    '(lambda shell, size: [shell.config.DistributedMagics.__setitem__("default_world_size", size)] + ' +
    '[setattr(m, "default_world_size", size) for m in shell.configurables ' +
    `if type(m).__name__ == "DistributedMagics"])(get_ipython(), ${size})`
  );
}

export class RanksField extends Widget {
  constructor(
    panel: NotebookPanel,
    states: ClusterStates,
    run: (code: string, panel: NotebookPanel) => Promise<void>
  ) {
    super();
    this.addClass('ddp-RanksField');
    this._panel = panel;
    this._states = states;
    this._run = run;
    const label = document.createElement('label');
    label.textContent = 'ranks ';
    this._input = document.createElement('input');
    this._input.type = 'number';
    this._input.min = '1';
    this._input.className = 'ddp-RanksField-input';
    this._input.setAttribute('aria-label', 'number of ranks');
    this._input.title = 'ranks of %dist_start without -n (kept in the notebook); a change restarts the cluster';
    label.appendChild(this._input);
    this.node.appendChild(label);
    this._input.addEventListener('change', () => void this._changed());
    this._input.addEventListener('keydown', event => {
      if (event.key === 'Enter') {
        event.preventDefault();
        void this._changed();
      }
    });
    states.changed.connect(this._show, this);
    void panel.context.ready.then(() => this._show());
    panel.sessionContext.kernelChanged.connect(() => void this._tellKernel());
    void panel.sessionContext.ready.then(() => this._tellKernel());
  }

  /** The size shown: the notebook's, else the running cluster's, else the kernel's default. */
  private _show(): void {
    if (document.activeElement === this._input) {
      return;
    }
    const state = this._states.current === this._panel ? this._states.state : null;
    const size =
      savedWorldSize(this._panel) ??
      (state && state.world_size ? state.world_size : null) ??
      (state && state.default_world_size ? state.default_world_size : null);
    this._input.value = size ? String(size) : '';
    this._input.placeholder = size ? '' : 'auto';
    this._shown = size;
  }

  private async _tellKernel(): Promise<void> {
    const size = savedWorldSize(this._panel);
    const kernel = this._panel.sessionContext.session?.kernel;
    if (size && kernel) {
      await kernel.requestExecute({ code: defaultSizeCode(size), silent: true, store_history: false }).done;
    }
  }

  private async _changed(): Promise<void> {
    const size = Number(this._input.value);
    if (this._busy || size === this._shown) {
      return; // Enter, then the change event as the field loses focus: one change
    }
    if (!Number.isSafeInteger(size) || size < 1) {
      this._show();
      return;
    }
    this._busy = true;
    try {
      await this._apply(size);
    } finally {
      this._busy = false;
      this._input.blur();
      this._show();
    }
  }

  private async _apply(size: number): Promise<void> {
    const state = this._states.current === this._panel ? this._states.state : null;
    const running = !!state && state.state !== 'none' && state.world_size > 0;
    if (running && state && state.world_size === size) {
      this._save(size);
      return;
    }
    if (running) {
      const answer = await showDialog({
        title: `Restart the cluster with ${size} ranks?`,
        body: `The ${state?.world_size} ranks stop, and everything defined on them is lost; ${size} new ranks start.`,
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: `Restart with ${size} ranks` })]
      });
      if (!answer.button.accept) {
        return;
      }
    }
    this._save(size);
    await this._tellKernel();
    if (running) {
      await this._run('%dist_stop\n%dist_start', this._panel);
    }
  }

  private _save(size: number): void {
    const saved: any = this._panel.context.model.getMetadata(METADATA_KEY) ?? {};
    this._panel.context.model.setMetadata(METADATA_KEY, { ...saved, world_size: size });
  }

  private _panel: NotebookPanel;
  private _states: ClusterStates;
  private _run: (code: string, panel: NotebookPanel) => Promise<void>;
  private _input: HTMLInputElement;
  private _shown: number | null = null;
  private _busy = false;
}
