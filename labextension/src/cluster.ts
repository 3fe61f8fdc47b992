// The cluster, live: what ddp_magics/lab_comm.py sends over the comm 'ddp_magics.cluster' for the
// current notebook's kernel, shown in a side panel (a row per rank, and Start, Recover, Restart
// and Stop, which execute the magics themselves and show their output) and in the status bar.

import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

export const COMM_TARGET = 'ddp_magics.cluster';

export interface IRankRow {
  rank: number;
  host: string;
  pid: number;
  device: string;
  state: string; // idle, running, hung, stopped, released, dead
  doing: string;
  line: number | null;
  code: string | null;
  unique: number | null;
  pss: number | null;
  resident: number | null;
}

export interface IClusterState {
  state: string; // none, idle, busy, hung, broken
  backend: string | null;
  world_size: number;
  ranks: IRankRow[];
  default_world_size?: number | null;
  problem?: string;
}

/** The latest state each notebook's kernel sent, and which notebook is current. */
export class ClusterStates {
  constructor(tracker: INotebookTracker) {
    this._tracker = tracker;
    tracker.widgetAdded.connect((_, panel) => this._watch(panel));
    tracker.currentChanged.connect(() => this._changed.emit(undefined));
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get current(): NotebookPanel | null {
    return this._tracker.currentWidget;
  }

  /** The current notebook's cluster, or null where its kernel has not loaded ddp_magics. */
  get state(): IClusterState | null {
    const panel = this.current;
    return panel ? this._states.get(panel) ?? null : null;
  }

  private _watch(panel: NotebookPanel): void {
    const session = panel.sessionContext;
    const register = () => {
      const kernel = session.session?.kernel;
      this._states.delete(panel);
      this._changed.emit(undefined);
      if (!kernel || this._registered.has(kernel)) {
        return;
      }
      this._registered.add(kernel);
      kernel.registerCommTarget(COMM_TARGET, (comm: Kernel.IComm, message: KernelMessage.ICommOpenMsg) => {
        this._update(panel, message.content.data);
        // Tells the kernel someone listens: only then does it ask running ranks where they are.
        comm.send({ listening: true });
        comm.onMsg = (update: KernelMessage.ICommMsgMsg) => this._update(panel, update.content.data);
        comm.onClose = () => {
          this._states.delete(panel);
          this._changed.emit(undefined);
        };
      });
    };
    session.kernelChanged.connect(register);
    void session.ready.then(register);
    panel.disposed.connect(() => {
      this._states.delete(panel);
      this._changed.emit(undefined);
    });
  }

  private _update(panel: NotebookPanel, data: any): void {
    const state = data && data.cluster;
    if (!state) {
      return;
    }
    this._states.set(panel, state as IClusterState);
    if (panel === this.current) {
      this._changed.emit(undefined);
    }
  }

  private _tracker: INotebookTracker;
  private _states = new Map<NotebookPanel, IClusterState>();
  private _registered = new WeakSet<Kernel.IKernelConnection>();
  private _changed = new Signal<this, void>(this);
}

export function summary(state: IClusterState | null): string {
  if (!state) {
    return 'ddp: not loaded';
  }
  if (state.state === 'none') {
    return 'ddp: no cluster';
  }
  return `ddp: ${state.backend} · ${state.world_size} ranks · ${state.state}`;
}

function bytes(count: number | null): string {
  if (count === null || count === undefined) {
    return '?';
  }
  if (count >= 1 << 30) {
    return `${(count / (1 << 30)).toFixed(1)} GiB`;
  }
  return `${(count / (1 << 20)).toFixed(1)} MiB`;
}

/** The status bar's item: backend, ranks, and idle/busy/hung/broken. */
export class ClusterStatusItem extends Widget {
  constructor(states: ClusterStates) {
    super();
    this.addClass('ddp-ClusterStatus');
    this._states = states;
    states.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const state = this._states.state;
    this.node.textContent = summary(state);
    this.node.dataset.state = state ? state.state : 'unloaded';
    this.node.title = 'ddp_magics: the current notebook\'s cluster';
  }

  private _states: ClusterStates;
}

const ACTIONS: [string, string, string][] = [
  ['Start', '%dist_start', 'start a cluster (the number of ranks in the toolbar)'],
  ['Recover', '%dist_recover', 'every rank back, its state kept (cuts hung collectives)'],
  ['Restart', '%dist_restart', 'new engines, same size (every rank\'s state is lost)'],
  ['Stop', '%dist_stop', 'stop the controller and the engines']
];

/** The side panel: the cluster's ranks, live, and the magics as buttons. */
export class ClusterPanel extends Widget {
  constructor(states: ClusterStates) {
    super();
    this.id = 'ddp-magics-cluster';
    this.addClass('ddp-ClusterPanel');
    this.title.caption = 'ddp_magics: the ranks';
    this.title.label = 'Ranks';
    this._states = states;
    this._summary = document.createElement('div');
    this._summary.className = 'ddp-ClusterPanel-summary';
    const buttons = document.createElement('div');
    buttons.className = 'ddp-ClusterPanel-buttons';
    for (const [label, code, caption] of ACTIONS) {
      const button = document.createElement('button');
      button.className = 'jp-Button ddp-ClusterPanel-button';
      button.textContent = label;
      button.title = `${code}: ${caption}`;
      button.dataset.action = label.toLowerCase();
      button.addEventListener('click', () => void this._run(code));
      buttons.appendChild(button);
      this._buttons.push(button);
    }
    this._table = document.createElement('table');
    this._table.className = 'ddp-ClusterPanel-ranks';
    this._output = document.createElement('pre');
    this._output.className = 'ddp-ClusterPanel-output';
    this.node.append(this._summary, buttons, this._table, this._output);
    states.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const state = this._states.state;
    this._summary.textContent = state
      ? summary(state).replace(/^ddp: /, '')
      : 'this notebook\'s kernel has not loaded ddp_magics (%load_ext ddp_magics)';
    this.node.dataset.state = state ? state.state : 'unloaded';
    for (const button of this._buttons) {
      button.disabled = !state || !this._states.current || this._running;
    }
    this._table.textContent = '';
    if (!state || !state.ranks.length) {
      return;
    }
    const head = this._table.createTHead().insertRow();
    for (const name of ['rank', 'host', 'pid', 'state', 'unique', 'pss']) {
      const cell = document.createElement('th');
      cell.textContent = name;
      head.appendChild(cell);
    }
    for (const row of state.ranks) {
      // One body per rank: its numbers on a line, what it runs or waits in on the next.
      const body = this._table.createTBody();
      body.className = `ddp-mod-${row.state}`;
      body.dataset.rank = String(row.rank);
      const tr = body.insertRow();
      for (const text of [
        String(row.rank),
        row.host,
        String(row.pid),
        row.state,
        bytes(row.unique),
        bytes(row.pss)
      ]) {
        tr.insertCell().textContent = text;
      }
      if (row.doing) {
        const doing = body.insertRow().insertCell();
        doing.colSpan = 6;
        doing.className = 'ddp-ClusterPanel-doing';
        doing.textContent =
          row.line !== null && row.code ? `${row.doing} — line ${row.line}: ${row.code}` : row.doing;
      }
    }
  }

  /** Execute a magic in the current notebook's kernel (or ``panel``'s), as typed in a cell, and
   * show its output here. */
  async run(code: string, panel: NotebookPanel | null = null): Promise<void> {
    return this._run(code, panel);
  }

  private async _run(code: string, target: NotebookPanel | null = null): Promise<void> {
    const panel = target ?? this._states.current;
    const kernel = panel?.sessionContext.session?.kernel;
    if (!kernel) {
      return;
    }
    this._running = true;
    this._render();
    this._output.textContent = '';
    this._output.textContent += `${code}\n`;
    try {
      const future = kernel.requestExecute({ code, silent: false, store_history: false, allow_stdin: false });
      future.onIOPub = (message: KernelMessage.IIOPubMessage) => {
        const content: any = message.content;
        const type = message.header.msg_type;
        if (type === 'stream') {
          this._output.textContent += content.text;
        } else if (type === 'error') {
          this._output.textContent += `${content.ename}: ${content.evalue}\n`;
        } else if ((type === 'display_data' || type === 'execute_result') && content.data['text/plain']) {
          this._output.textContent += `${content.data['text/plain']}\n`;
        }
      };
      await future.done;
    } finally {
      this._running = false;
      this._render();
    }
  }

  private _states: ClusterStates;
  private _summary: HTMLElement;
  private _table: HTMLTableElement;
  private _output: HTMLElement;
  private _buttons: HTMLButtonElement[] = [];
  private _running = false;
}
