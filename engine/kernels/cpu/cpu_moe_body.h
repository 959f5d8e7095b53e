// The float32 experts' loops of cpu_moe.cpp for one instruction set. cpu_moe.cpp includes this
// file twice, once inside a namespace compiled for AVX-512 and once inside one for AVX2, each
// defining first what the loops are written in: Vec (kLanes float32), kGateUpRows and
// kDownRows, kDownPanels (activation rows and down panels multiplied together), zero, fma,
// broadcast, load (kLanes float32, or bfloat16 widened to float32), store and silu_mul
// (silu(gate) * up, lane by lane). So no guard: each inclusion is its own code.
//
// Every panel is kPanel (16) columns, whatever the vector width: one packed layout serves both
// instruction sets (an AVX2 vector holds half a panel). The weights W are float32, or bfloat16
// (uint16_t) widened exactly to float32 as they are loaded: the same products at half the
// bytes. A row's sums run over the inputs in order, one fused multiply-add each, whichever
// other rows share its expert.

constexpr int kVecs = kPanel / kLanes;  // vectors per panel

// While a block of rows is multiplied, its share of the weights the caller reads next comes
// into L2 (every pass over a panel then overlaps the next panel's memory traffic, not only the
// first pass): from `at` (or nowhere: nullptr), one k in `every` prefetches as many values as
// one k of the panel holds. Row block b of n takes share b of n (share() below). Measured on a
// loaded 2-core Xeon VM, 64 tokens: about 15-30% faster than prefetching the next panel
// whole during the first block only.
template <typename W>
struct Prefetch {
  const W* at;
  int64_t every;
};

// `count` weights from `at` into L2, a cache line at a time.
template <typename W>
inline void prefetch_values(const W* at, int64_t count) {
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(W)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at) + byte, _MM_HINT_T1);
}

// Rows x[m] (m < M, `hidden` apart) times gate_up panel `panel` ([hidden][2 * kPanel], its
// gate's 16 columns then its up's): h[m * h_row + c] = silu(gate) * up for the 16 columns c.
template <int M, typename W>
inline void gate_up_rows(const float* x, int64_t hidden, const W* panel, Prefetch<W> prefetch,
                         float* h, int64_t h_row) {
  Vec gate[M][kVecs], up[M][kVecs];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVecs; ++v) gate[m][v] = up[m][v] = zero();
  const W* ahead = prefetch.at;
  int64_t wait = 0;
  for (int64_t k = 0; k < hidden; ++k) {
    const W* w = panel + k * 2 * kPanel;
    if (ahead != nullptr && wait-- == 0) {
      prefetch_values(ahead, 2 * kPanel);
      ahead += 2 * kPanel;
      wait = prefetch.every - 1;
    }
    Vec wg[kVecs], wu[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      wg[v] = load(w + v * kLanes);
      wu[v] = load(w + kPanel + v * kLanes);
    }
    for (int m = 0; m < M; ++m) {
      const Vec xm = broadcast(x[m * hidden + k]);
      for (int v = 0; v < kVecs; ++v) {
        gate[m][v] = fma(wg[v], xm, gate[m][v]);
        up[m][v] = fma(wu[v], xm, up[m][v]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVecs; ++v) store(h + m * h_row + v * kLanes, silu_mul(gate[m][v], up[m][v]));
}

// Rows h[m] (m < M, `h_row` apart, `inter` values each) times P down panels (each
// [inter][kPanel], `panel_values` apart): the sums of row m, panel p go to y[m * hidden +
// first + 16 p + c] for the columns c below `hidden`.
template <int M, int P, typename W>
inline void down_rows(const float* h, int64_t h_row, int64_t inter, const W* panels,
                      int64_t panel_values, Prefetch<W> prefetch, float* y, int64_t hidden,
                      int64_t first) {
  Vec acc[M][P][kVecs];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kVecs; ++v) acc[m][p][v] = zero();
  const W* ahead = prefetch.at;
  int64_t wait = 0;
  for (int64_t k = 0; k < inter; ++k) {
    if (ahead != nullptr && wait-- == 0) {
      for (int p = 0; p < P; ++p) prefetch_values(ahead + p * panel_values, kPanel);
      ahead += kPanel;
      wait = prefetch.every - 1;
    }
    Vec w[P][kVecs];
    for (int p = 0; p < P; ++p) {
      const W* at = panels + p * panel_values + k * kPanel;
      for (int v = 0; v < kVecs; ++v) w[p][v] = load(at + v * kLanes);
    }
    for (int m = 0; m < M; ++m) {
      const Vec hm = broadcast(h[m * h_row + k]);
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kVecs; ++v) acc[m][p][v] = fma(w[p][v], hm, acc[m][p][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < P; ++p) {
      const int64_t column = first + p * kPanel;
      float* to = y + m * hidden + column;
      if (column + kPanel <= hidden) {
        for (int v = 0; v < kVecs; ++v) store(to + v * kLanes, acc[m][p][v]);
      } else {  // the last panel of an output size that is not a multiple of 16
        float values[kPanel];
        for (int v = 0; v < kVecs; ++v) store(values + v * kLanes, acc[m][p][v]);
        for (int64_t c = 0; c < hidden - column; ++c) to[c] = values[c];
      }
    }
}

// gate_up_rows for `rows` (1 to M) rows, each count its own unrolled code.
template <int M = kGateUpRows, typename W>
inline void gate_up_upto(int64_t rows, const float* x, int64_t hidden, const W* panel,
                         Prefetch<W> prefetch, float* h, int64_t h_row) {
  if constexpr (M > 1) {
    if (rows < M) return gate_up_upto<M - 1, W>(rows, x, hidden, panel, prefetch, h, h_row);
  }
  gate_up_rows<M, W>(x, hidden, panel, prefetch, h, h_row);
}

// down_rows for `rows` (1 to M) rows and `panels` (1 to P) panels.
template <int M = kDownRows, int P = kDownPanels, typename W>
inline void down_upto(int64_t rows, int64_t panels, const float* h, int64_t h_row,
                      int64_t inter, const W* w, int64_t panel_values, Prefetch<W> prefetch,
                      float* y, int64_t hidden, int64_t first) {
  if constexpr (P > 1) {
    if (panels < P)
      return down_upto<M, P - 1, W>(rows, panels, h, h_row, inter, w, panel_values, prefetch, y,
                                 hidden, first);
  }
  if constexpr (M > 1) {
    if (rows < M)
      return down_upto<M - 1, P, W>(rows, panels, h, h_row, inter, w, panel_values, prefetch, y,
                                 hidden, first);
  }
  down_rows<M, P, W>(h, h_row, inter, w, panel_values, prefetch, y, hidden, first);
}

// The share of `next` (a panel of `length` k, `values` weights per k; or nullptr) that row
// block `block` of `blocks` prefetches.
template <typename W>
inline Prefetch<W> share(const W* next, int64_t length, int64_t values, int64_t block,
                         int64_t blocks) {
  if (next == nullptr) return {nullptr, 1};
  return {next + block * ((length + blocks - 1) / blocks) * values, blocks};
}

// Both products of every expert that got rows: first each (expert, gate_up panel) pair is a
// task (all experts' in one parallel loop), then each (expert, kDownPanels down panels).
// Within a task the rows go kGateUpRows (kDownRows) at a time, every block rereading the
// panel from L2 while a share of the next task's panel comes in.
template <typename W>
inline void run_experts(const ExpertProblem& p) {
  const int64_t up_panels = p.gate_up.size(1), inter = up_panels * kPanel;
  const int64_t gate_up_values = p.hidden * 2 * kPanel;
  for_panel_tasks(p, static_cast<const W*>(p.gate_up.data_ptr()), up_panels, 1, gate_up_values,
                  [&](int64_t u, int64_t j, const W* panel, const W* next) {
    const int64_t count = p.start[u + 1] - p.start[u];
    const int64_t blocks = (count + kGateUpRows - 1) / kGateUpRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = p.start[u] + b * kGateUpRows;
      const int64_t rows = std::min<int64_t>(kGateUpRows, p.start[u + 1] - r);
      gate_up_upto(rows, p.x + r * p.hidden, p.hidden, panel,
                   share(next, p.hidden, 2 * kPanel, b, blocks), p.h + r * inter + j * kPanel,
                   inter);
    }
  });
  const int64_t down_panels = p.down.size(1), down_values = inter * kPanel;
  for_panel_tasks(p, static_cast<const W*>(p.down.data_ptr()), down_panels, kDownPanels,
                  down_values, [&](int64_t u, int64_t j, const W* w, const W* next) {
    const int64_t panels = std::min<int64_t>(kDownPanels, down_panels - j);
    const int64_t count = p.start[u + 1] - p.start[u];
    const int64_t blocks = (count + kDownRows - 1) / kDownRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = p.start[u] + b * kDownRows;
      const int64_t rows = std::min<int64_t>(kDownRows, p.start[u + 1] - r);
      down_upto(rows, panels, p.h + r * inter, inter, inter, w, down_values,
                share(next, inter, kPanel, b, blocks), p.y + r * p.hidden, p.hidden,
                j * kPanel);
    }
  });
}
