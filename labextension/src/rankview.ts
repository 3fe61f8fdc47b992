// The rank view: a %%distributed cell's outcome as tabs, one per rank or group of ranks whose
// output and state are identical (a selector past MAX_TABS), and a compare grid. It renders the
// record ddp_magics/lab_bundle.py puts under RANKS_MIMETYPE; rich displays inside it go through
// JupyterLab's own renderers.

import { IRenderMimeRegistry, MimeModel } from '@jupyterlab/rendermime';
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

export const RANKS_MIMETYPE = 'application/vnd.ddp-magics.ranks+json';
export const MAX_TABS = 8;

export interface IWhere {
  line: number | null;
  code: string | null;
  call: string | null;
  text: string;
}

export interface IRankRecord {
  rank: number;
  state: string; // finished, raised, hung, released, dead, stopped
  stdout: string;
  stderr: string;
  result: string;
  displays: { data: Record<string, any>; metadata: Record<string, any> }[];
  displays_below?: number;
  error: { ename: string; evalue: string } | null;
  where: IWhere | null;
}

export interface IRankViewData {
  version: number;
  ranks: IRankRecord[];
  groups: { ranks: number[]; label: string }[];
  displays_below: boolean;
}

const STATE_MARK: Record<string, string> = {
  finished: '',
  raised: '✗',
  hung: '⏸',
  stopped: '■',
  released: '↺',
  dead: '†'
};

/** One line saying how the rank ended, or '' when it finished by itself. */
export function stateLine(record: IRankRecord): string {
  switch (record.state) {
    case 'raised':
      return `raised ${record.error?.ename ?? 'an exception'}: ${record.error?.evalue ?? ''}`;
    case 'hung':
      return `still running (hung) ${whereText(record.where)}`;
    case 'stopped':
      return `stopped ${whereText(record.where)}`;
    case 'released':
      return `released ${whereText(record.where)} (its group was cut and formed anew; state kept)`;
    case 'dead':
      return 'dead: its process ended';
    default:
      return '';
  }
}

function whereText(where: IWhere | null): string {
  if (!where) {
    return '';
  }
  const code = where.line !== null && where.code ? ` — line ${where.line}: ${where.code}` : '';
  return `${where.text}${code}`;
}

export class RankView extends Widget implements IRenderMime.IRenderer {
  constructor(
    options: IRenderMime.IRendererOptions,
    rendermime: IRenderMimeRegistry | null
  ) {
    super();
    this._mimeType = options.mimeType;
    this._rendermime = rendermime;
    this.addClass('ddp-RankView');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    this._data = model.data[this._mimeType] as unknown as IRankViewData;
    this._trusted = model.trusted;
    await this._render();
  }

  private async _render(): Promise<void> {
    const data = this._data;
    for (const child of this._children) {
      child.dispose();
    }
    this._children = [];
    this.node.textContent = '';
    if (!data || !Array.isArray(data.groups) || !Array.isArray(data.ranks)) {
      return;
    }
    const records = new Map(data.ranks.map(record => [record.rank, record]));
    const groups = data.groups.filter(group => group.ranks.length > 0);
    if (this._selected >= groups.length) {
      this._selected = 0;
    }
    const bar = document.createElement('div');
    bar.className = 'ddp-RankView-bar';
    this.node.appendChild(bar);
    if (groups.length > MAX_TABS) {
      const select = document.createElement('select');
      select.className = 'ddp-RankView-select';
      select.setAttribute('aria-label', 'rank');
      groups.forEach((group, index) => {
        const option = document.createElement('option');
        option.value = String(index);
        const record = records.get(group.ranks[0]);
        const mark = record ? STATE_MARK[record.state] ?? '' : '';
        option.textContent = mark ? `${group.label} ${mark}` : group.label;
        select.appendChild(option);
      });
      select.value = String(this._selected);
      select.disabled = this._compare;
      select.addEventListener('change', () => {
        this._selected = Number(select.value);
        void this._render();
      });
      bar.appendChild(select);
    } else if (groups.length > 1 || !this._compare) {
      groups.forEach((group, index) => {
        const tab = document.createElement('button');
        const record = records.get(group.ranks[0]);
        const state = record?.state ?? 'finished';
        tab.className = `ddp-RankView-tab ddp-mod-${state}`;
        tab.setAttribute('role', 'tab');
        tab.dataset.ranks = group.ranks.join(',');
        const selected = !this._compare && index === this._selected;
        tab.setAttribute('aria-selected', String(selected));
        if (selected) {
          tab.classList.add('ddp-mod-selected');
        }
        const mark = STATE_MARK[state] ?? '';
        tab.textContent = mark ? `${group.label} ${mark}` : group.label;
        tab.title = record ? stateLine(record) || 'finished' : '';
        tab.addEventListener('click', () => {
          this._selected = index;
          this._compare = false;
          void this._render();
        });
        bar.appendChild(tab);
      });
    }
    if (groups.length > 1) {
      const compare = document.createElement('button');
      compare.className = 'ddp-RankView-compare';
      compare.textContent = this._compare ? 'tabs' : 'compare';
      compare.title = this._compare ? 'one group of ranks at a time' : 'every group side by side';
      compare.addEventListener('click', () => {
        this._compare = !this._compare;
        void this._render();
      });
      bar.appendChild(compare);
    }
    const shown = this._compare ? groups : [groups[this._selected]];
    const body = document.createElement('div');
    body.className = this._compare ? 'ddp-RankView-grid' : 'ddp-RankView-panel';
    this.node.appendChild(body);
    for (const group of shown) {
      const record = records.get(group.ranks[0]);
      if (!record) {
        continue;
      }
      const column = document.createElement('div');
      column.className = `ddp-RankView-ranks ddp-mod-${record.state}`;
      column.dataset.ranks = group.ranks.join(',');
      if (this._compare) {
        const head = document.createElement('div');
        head.className = 'ddp-RankView-head';
        head.textContent = `[${group.label}]`;
        column.appendChild(head);
      }
      body.appendChild(column);
      await this._renderRecord(record, column);
    }
  }

  private async _renderRecord(record: IRankRecord, into: HTMLElement): Promise<void> {
    const line = stateLine(record);
    if (line) {
      const state = document.createElement('div');
      state.className = 'ddp-RankView-state';
      state.textContent = line;
      into.appendChild(state);
    }
    for (const [text, cls] of [
      [record.stdout, 'ddp-RankView-stdout'],
      [record.stderr, 'ddp-RankView-stderr'],
      [record.result, 'ddp-RankView-result']
    ]) {
      if (text) {
        const pre = document.createElement('pre');
        pre.className = cls;
        pre.textContent = text;
        into.appendChild(pre);
      }
    }
    for (const display of record.displays ?? []) {
      const item = document.createElement('div');
      item.className = 'ddp-RankView-display';
      into.appendChild(item);
      const rendermime = this._rendermime;
      const mimeType = rendermime?.preferredMimeType(display.data, this._trusted ? 'any' : 'ensure');
      if (!rendermime || !mimeType) {
        const pre = document.createElement('pre');
        pre.textContent = String(display.data['text/plain'] ?? '');
        item.appendChild(pre);
        continue;
      }
      const renderer = rendermime.createRenderer(mimeType);
      await renderer.renderModel(
        new MimeModel({ data: display.data, metadata: display.metadata, trusted: this._trusted })
      );
      Widget.attach(renderer, item);
      this._children.push(renderer);
    }
    if (record.displays_below) {
      const note = document.createElement('div');
      note.className = 'ddp-RankView-note';
      note.textContent = `${record.displays_below} display(s) shown below the view`;
      into.appendChild(note);
    }
    if (!line && !record.stdout && !record.stderr && !record.result && !(record.displays ?? []).length) {
      const empty = document.createElement('div');
      empty.className = 'ddp-RankView-note';
      empty.textContent = 'no output';
      into.appendChild(empty);
    }
  }

  onBeforeDetach(): void {
    for (const child of this._children) {
      if (child.isAttached) {
        Widget.detach(child);
      }
    }
  }

  dispose(): void {
    for (const child of this._children) {
      child.dispose();
    }
    this._children = [];
    super.dispose();
  }

  private _mimeType: string;
  private _rendermime: IRenderMimeRegistry | null;
  private _data: IRankViewData | null = null;
  private _trusted = false;
  private _selected = 0;
  private _compare = false;
  private _children: Widget[] = [];
}
