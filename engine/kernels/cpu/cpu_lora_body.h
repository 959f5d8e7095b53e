// The grouped LoRA kernel's loops for one instruction set. cpu_lora.cpp includes this file
// three times, inside namespaces compiled for AVX-512 BF16, AVX-512 and AVX2, each defining
// first what the loops are written in: Vec (a vector of kLanes float32), kRowBlock
// (activation rows the shrink multiplies together), kExpandRows (the expand's), zero, fma,
// broadcast, add, sum (of a vector's lanes), load (kLanes float32, bfloat16 or float16 values
// widened to float32), store (a vector rounded to the element type), and Columns, load_columns
// and in_order (two vectors of B's columns from one step, and their sums put back in column
// order); the AVX-512 BF16 one defines FOLIO_LORA_BF16_DOT too
// (bfloat16's shrink in vdpbf16ps, Dot below). So no guard: each inclusion is its own code.
//
// Each sum runs one order whatever the call's other rows: a row's result never depends on
// which rows share its group, its slot's group or the call (the vector part, its horizontal
// sum, then the tail one value at a time; std::fma in the tails, which rounds as a vector
// fma lane does).

// The shrink's dot products, kStep values of A and of x at a time (`X` holds them as one
// step takes them): each value widened to float32, one multiply-add per value into its lane.
template <typename T>
struct Dot {
  static constexpr int kStep = kLanes;
  using X = Vec;
  static X take(const T* values) { return load(values); }
  static Vec add(Vec sums, X a, X x) { return fma(a, x, sums); }
};

#ifdef FOLIO_LORA_BF16_DOT
// bfloat16 on CPUs with AVX-512 BF16: vdpbf16ps takes 32 values of A and of x as they are
// stored and adds each lane's pair of products (exact in float32) to its sum: one instruction
// for 32 values of A, where the widened code spends six (two to widen each 16, a multiply-add)
// and widens x again for each pass over A's rows. So the shrink, most of a decode step's
// adapter bytes, goes at the rate they are read rather than the rate of that arithmetic.
// Another order of float32 sums than the widened code's; like it, a row's sums never depend
// on the other rows.
template <>
struct Dot<c10::BFloat16> {
  static constexpr int kStep = 32;
  using X = __m512bh;
  static X take(const c10::BFloat16* values) {
    return reinterpret_cast<X>(_mm512_loadu_si512(values));
  }
  static Vec add(Vec sums, X a, X x) { return _mm512_dpbf16_ps(sums, a, x); }
};
#endif

// The next group's A and B (a thread's next slot in run's whole-groups pass), handed to the L2
// cache a line at a time as this group reads its own: the hardware prefetcher alone runs too
// little ahead of the arithmetic for the reads to overlap it (bench.lora_kernel, one thread:
// about 10 to 17% less time a step). Prefetches never change a value.
struct Ahead {
  const char* at[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};
  // Hints the next `bytes` of the next group's A, then of its B, to the L2 cache.
  inline void lines(int64_t bytes) {
    for (int s = 0; s < 2 && bytes > 0; ++s)
      for (; at[s] < end[s] && bytes > 0; at[s] += 64, bytes -= 64)
        _mm_prefetch(at[s], _MM_HINT_T1);
  }
};

// shrunk[row][k] (k < K) = a[k] . x[row] for rows rows[0 .. M): K rows of one slot's A, `in`
// long, `in` apart; `shrunk` points at the task's first column.
template <int K, int M, typename T>
inline void shrink_rows(const Problem<T>& p, const T* a, const int32_t* rows, float* shrunk) {
  using D = Dot<T>;
  const int64_t in = p.in, body = in - in % D::kStep;
  const T* xs[M];
  for (int m = 0; m < M; ++m) xs[m] = p.x + rows[m] * p.x_stride;
  Vec acc[K][M];
  for (int k = 0; k < K; ++k)
    for (int m = 0; m < M; ++m) acc[k][m] = zero();
  for (int64_t i = 0; i < body; i += D::kStep) {
    typename D::X xv[M];
    for (int m = 0; m < M; ++m) xv[m] = D::take(xs[m] + i);
    for (int k = 0; k < K; ++k) {
      const typename D::X av = D::take(a + k * in + i);
      for (int m = 0; m < M; ++m) acc[k][m] = D::add(acc[k][m], av, xv[m]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int m = 0; m < M; ++m) {
      float s = sum(acc[k][m]);
      for (int64_t i = body; i < in; ++i)
        s = std::fma(static_cast<float>(a[k * in + i]), static_cast<float>(xs[m][i]), s);
      shrunk[rows[m] * p.width + k] = s;
    }
}

// shrink_rows for k (1 to K) rows of A and m (1 to M) activation rows, each count its own
// unrolled code.
template <int K, int M, typename T>
inline void shrink_upto(int64_t k, int64_t m, const Problem<T>& p, const T* a,
                        const int32_t* rows, float* shrunk) {
  if constexpr (K > 1) {
    if (k < K) return shrink_upto<K - 1, M>(k, m, p, a, rows, shrunk);
  }
  if constexpr (M > 1) {
    if (m < M) return shrink_upto<K, M - 1>(k, m, p, a, rows, shrunk);
  }
  shrink_rows<K, M>(p, a, rows, shrunk);
}

// out[row][o0 + j] = y[row][o0 + j] + sum over r of bt[r][j] * shrunk[row][column + r], for
// j < n and rows rows[0 .. M): bt is one slot's tile of B (`rank` rows of `tile_width`
// values), `column` the tile's shard's first column of the shrunk values. Two vectors of
// columns a step (load_columns: bfloat16's even and odd columns, each a shift or a mask from
// one load), so each row has two independent chains of sums; every column's sum takes the
// same multiply-adds in the same order as one vector at a time would.
template <int M, typename T>
inline void expand_rows(const Problem<T>& p, const T* bt, const int32_t* rows, int64_t o0,
                        int64_t n, int64_t column) {
  const int64_t out = p.out_features, tile = p.tile_width;
  const int64_t pairs = n - n % (2 * kLanes), body = n - n % kLanes;
  const float* shrunk[M];
  for (int m = 0; m < M; ++m) shrunk[m] = p.shrunk + rows[m] * p.width + column;
  for (int64_t j = 0; j < pairs; j += 2 * kLanes) {
    Vec acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = zero();
    for (int64_t r = 0; r < p.rank; ++r) {
      const Columns bv = load_columns(bt + r * tile + j);
      for (int m = 0; m < M; ++m) {
        const Vec s = broadcast(shrunk[m][r]);
        acc[m][0] = fma(bv.v[0], s, acc[m][0]);
        acc[m][1] = fma(bv.v[1], s, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const Columns sums = in_order(acc[m], bt);
      const int64_t at = rows[m] * out + o0 + j;
      store(p.out + at, add(load(p.y + at), sums.v[0]));
      store(p.out + at + kLanes, add(load(p.y + at + kLanes), sums.v[1]));
    }
  }
  for (int64_t j = pairs; j < body; j += kLanes) {
    Vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero();
    for (int64_t r = 0; r < p.rank; ++r) {
      const Vec bv = load(bt + r * tile + j);
      for (int m = 0; m < M; ++m) acc[m] = fma(bv, broadcast(shrunk[m][r]), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      const int64_t at = rows[m] * out + o0 + j;
      store(p.out + at, add(load(p.y + at), acc[m]));
    }
  }
  for (int64_t j = body; j < n; ++j)
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t r = 0; r < p.rank; ++r)
        s = std::fma(static_cast<float>(bt[r * tile + j]), shrunk[m][r], s);
      const int64_t at = rows[m] * out + o0 + j;
      p.out[at] = static_cast<T>(static_cast<float>(p.y[at]) + s);
    }
}

template <int M, typename T>
inline void expand_upto(int64_t m, const Problem<T>& p, const T* bt, const int32_t* rows,
                        int64_t o0, int64_t n, int64_t column) {
  if constexpr (M > 1) {
    if (m < M) return expand_upto<M - 1>(m, p, bt, rows, o0, n, column);
  }
  expand_rows<M>(p, bt, rows, o0, n, column);
}

// One group's shrink over its rows, tasks [begin, end) of it (kShrinkRows rows of A each),
// hinting as many bytes of `ahead` as it reads of A.
template <typename T>
inline void shrink_group(const Problem<T>& p, const Group& g, int64_t w_begin, int64_t w_end,
                         Ahead& ahead) {
  for (int64_t w0 = w_begin; w0 < w_end; w0 += kShrinkRows) {
    const T* a = p.a + (g.slot * p.width + w0) * p.in;
    const int64_t k = std::min<int64_t>(kShrinkRows, p.width - w0);
    ahead.lines(k * p.in * static_cast<int64_t>(sizeof(T)));
    for (int64_t i = g.begin; i < g.end; i += kRowBlock)
      shrink_upto<kShrinkRows, kRowBlock>(k, std::min<int64_t>(kRowBlock, g.end - i), p, a,
                                          p.order.data() + i, p.shrunk + w0);
  }
}

// One group's expand over output tiles [begin, end) (a slot's tiles lie one after the other),
// hinting as many bytes of `ahead` as it reads of B.
template <typename T>
inline void expand_group(const Problem<T>& p, const Group& g, int64_t begin, int64_t end,
                         Ahead& ahead) {
  const int64_t tile_values = p.rank * p.tile_width;
  const T* slot_tiles = p.b + g.slot * static_cast<int64_t>(p.tiles.size()) * tile_values;
  for (int64_t t = begin; t < end; ++t) {
    ahead.lines(tile_values * static_cast<int64_t>(sizeof(T)));
    const Tile tile = p.tiles[t];
    for (int64_t i = g.begin; i < g.end; i += kExpandRows)
      expand_upto<kExpandRows>(std::min<int64_t>(kExpandRows, g.end - i), p,
                             slot_tiles + t * tile_values, p.order.data() + i, tile.o0, tile.n,
                             tile.shard * p.rank);
  }
}

// The base model's rows base_rows[begin .. end): y's values.
template <typename T>
inline void copy_base_rows(const Problem<T>& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t at = p.base_rows[i] * p.out_features;
    std::copy(p.y + at, p.y + at + p.out_features, p.out + at);
  }
}

// The whole product. With at least two groups per thread (a decode step over many adapters),
// each thread takes whole groups, shrink then expand, in one parallel pass: its slots' A and
// B read front to back, no wait between the phases, each group hinting its next one's to the
// L2 cache (Ahead; every slot's A and B are the same size). Otherwise (one or a few adapters)
// every group's shrink is split into tasks of kShrinkRows rows of A, then its expand into runs
// of output tiles, so that a lone adapter's rows still use every thread. Either way each used
// slot's A and B are read once.
template <typename T>
void run(const Problem<T>& p) {
  const int64_t groups = static_cast<int64_t>(p.groups.size());
  const int64_t tiles = static_cast<int64_t>(p.tiles.size());
  const int64_t base = static_cast<int64_t>(p.base_rows.size());
  if (groups >= 2 * at::get_num_threads()) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const int64_t a_bytes = p.width * p.in * static_cast<int64_t>(sizeof(T));
      const int64_t b_bytes = tiles * p.rank * p.tile_width * static_cast<int64_t>(sizeof(T));
      for (int64_t g = begin; g < end; ++g) {
        Ahead ahead;
        if (g + 1 < end) {
          const int64_t next = p.groups[g + 1].slot;
          ahead.at[0] = reinterpret_cast<const char*>(p.a) + next * a_bytes;
          ahead.at[1] = reinterpret_cast<const char*>(p.b) + next * b_bytes;
          ahead.end[0] = ahead.at[0] + a_bytes;
          ahead.end[1] = ahead.at[1] + b_bytes;
        }
        shrink_group(p, p.groups[g], 0, p.width, ahead);
        expand_group(p, p.groups[g], 0, tiles, ahead);
      }
      copy_base_rows(p, begin * base / groups, end * base / groups);
    });
    return;
  }
  const int64_t per_group = (p.width + kShrinkRows - 1) / kShrinkRows;
  at::parallel_for(0, groups * per_group, 1, [&](int64_t begin, int64_t end) {
    Ahead none;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t w0 = (t % per_group) * kShrinkRows;
      shrink_group(p, p.groups[t / per_group], w0, w0 + kShrinkRows, none);
    }
  });
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    Ahead none;
    for (const Group& g : p.groups) expand_group(p, g, begin, end, none);
    copy_base_rows(p, begin * base / tiles, end * base / tiles);
  });
}
