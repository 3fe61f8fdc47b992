// ddp_magics in JupyterLab: the rank view of each %%distributed cell, the cluster live in a side
// panel and the status bar, and the number of ranks in the notebook toolbar.

import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { IStatusBar } from '@jupyterlab/statusbar';

import { ClusterPanel, ClusterStates, ClusterStatusItem } from './cluster';
import { RANKS_MIMETYPE, RankView } from './rankview';
import { RanksField } from './toolbar';

/** Outputs after the first of a cell that the rank view shows already (a figure of a rank, the
 * rank blocks after it) are marked so in their metadata by the magic; they are hidden here. */
function hideShownInRankView(panel: NotebookPanel): void {
  for (const cell of panel.content.widgets) {
    const area = (cell as any).outputArea;
    if (!area || !area.model) {
      continue;
    }
    const count = Math.min(area.model.length, area.widgets.length);
    for (let index = 0; index < count; index++) {
      const metadata = area.model.get(index)?.metadata as any;
      const shown = !!(metadata && metadata.ddp_magics && metadata.ddp_magics.in_rank_view);
      area.widgets[index].toggleClass('ddp-mod-inRankView', shown);
    }
  }
}

function watchOutputs(panel: NotebookPanel): void {
  let scheduled = false;
  const observer = new MutationObserver(() => {
    if (!scheduled) {
      scheduled = true;
      requestAnimationFrame(() => {
        scheduled = false;
        hideShownInRankView(panel);
      });
    }
  });
  observer.observe(panel.content.node, { childList: true, subtree: true });
  panel.disposed.connect(() => observer.disconnect());
  hideShownInRankView(panel);
}

const rankViewPlugin: JupyterFrontEndPlugin<void> = {
  id: 'ddp-magics:rank-view',
  description: 'A %%distributed cell as tabs of ranks and a compare grid.',
  autoStart: true,
  requires: [IRenderMimeRegistry],
  optional: [INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    rendermime: IRenderMimeRegistry,
    tracker: INotebookTracker | null
  ) => {
    rendermime.addFactory(
      {
        safe: true,
        mimeTypes: [RANKS_MIMETYPE],
        defaultRank: 10,
        createRenderer: options => new RankView(options, rendermime)
      },
      10
    );
    tracker?.widgetAdded.connect((_, panel) => watchOutputs(panel));
  }
};

const clusterPlugin: JupyterFrontEndPlugin<void> = {
  id: 'ddp-magics:cluster',
  description: 'The cluster live: a side panel, a status-bar item, the number of ranks in the toolbar.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null
  ) => {
    const states = new ClusterStates(tracker);
    const panel = new ClusterPanel(states);
    if (labShell) {
      labShell.add(panel, 'right', { rank: 900 });
    }
    if (statusBar) {
      statusBar.registerStatusItem('ddp-magics:cluster-status', {
        item: new ClusterStatusItem(states),
        align: 'left',
        rank: 4,
        isActive: () => !!tracker.currentWidget && tracker.currentWidget === app.shell.currentWidget
      });
    }
    tracker.widgetAdded.connect((_, notebook) => {
      const field = new RanksField(notebook, states, (code, target) => panel.run(code, target));
      if (!notebook.toolbar.insertAfter('kernelName', 'ddp-magics-ranks', field)) {
        notebook.toolbar.addItem('ddp-magics-ranks', field);
      }
      notebook.disposed.connect(() => field.dispose());
    });
  }
};

export default [rankViewPlugin, clusterPlugin];
