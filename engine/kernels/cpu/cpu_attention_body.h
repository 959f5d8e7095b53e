// The decode attention's loops of cpu_attention.cpp for one instruction set: a row's scores, eight
// positions at a time, and the values they mix. cpu_attention.cpp includes this file twice, once
// inside a namespace compiled for AVX-512 and once inside one for AVX2, each defining first what
// the loops are written in: Vec (kLanes float32), zero, fma, broadcast, load (kLanes float32, or
// bfloat16 or fp8 widened exactly to float32), store, sum (a vector's lanes added) and sum_8 (eight
// vectors' lanes added, each into one lane of an AVX2 vector). So no guard: each inclusion is its
// own code. head_dim is a multiple of kLanes. Each instruction set sums in its own order, so a
// token's output bits depend on which one ran (never on its step or its batch).

// a . b over d features: two chains of kLanes, then the vector's lanes.
template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  Vec acc0 = zero(), acc1 = zero();
  int64_t i = 0;
#pragma GCC unroll 4
  for (; i + 2 * kLanes <= d; i += 2 * kLanes) {
    acc0 = fma(load(a + i), load(b + i), acc0);
    acc1 = fma(load(a + i + kLanes), load(b + i + kLanes), acc1);
  }
  for (; i < d; i += kLanes) acc0 = fma(load(a + i), load(b + i), acc0);
  return sum(add(acc0, acc1));
}

// For query heads g < HEADS of one KV head: out[g * head_dim + kLanes c ..] += sum over t <
// count of p[g * p_stride + t] * values[t * stride + kLanes c ..], c < CHUNKS: one block's
// positions. Each value vector is loaded once for all the heads, and the sums stay in registers
// over the block (HEADS x CHUNKS accumulators, at most 12 of AVX2's 16 registers).
template <typename T, int HEADS, int CHUNKS>
inline void mix_values(const T* values, int64_t count, int64_t stride, const float* p,
                       int64_t p_stride, float* out, int64_t out_stride) {
  Vec acc[HEADS][CHUNKS];
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < CHUNKS; ++c) acc[g][c] = load(out + g * out_stride + kLanes * c);
  for (int64_t t = 0; t < count; ++t, values += stride) {
    Vec w[HEADS];
    for (int g = 0; g < HEADS; ++g) w[g] = broadcast(p[g * p_stride + t]);
    for (int c = 0; c < CHUNKS; ++c) {
      const Vec v = load(values + kLanes * c);
      for (int g = 0; g < HEADS; ++g) acc[g][c] = fma(w[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < CHUNKS; ++c) store(out + g * out_stride + kLanes * c, acc[g][c]);
}

// mix_values for `heads` (1 to 3) heads over a slab of `chunks` (1 to 4) vectors of features.
template <typename T, int HEADS = 3, int CHUNKS = 4>
inline void mix_slab(int64_t heads, int64_t chunks, const T* values, int64_t count,
                     int64_t stride, const float* p, int64_t p_stride, float* out,
                     int64_t out_stride) {
  if constexpr (HEADS > 1) {
    if (heads < HEADS)
      return mix_slab<T, HEADS - 1, CHUNKS>(heads, chunks, values, count, stride, p, p_stride,
                                            out, out_stride);
  }
  if constexpr (CHUNKS > 1) {
    if (chunks < CHUNKS)
      return mix_slab<T, HEADS, CHUNKS - 1>(heads, chunks, values, count, stride, p, p_stride,
                                            out, out_stride);
  }
  mix_values<T, HEADS, CHUNKS>(values, count, stride, p, p_stride, out, out_stride);
}

// The eight dot products q . key[j] (j < 8, keys `stride` values apart, d features), as one
// AVX2 vector.
template <typename T>
inline __m256 dot_8_keys(const float* q, const T* key, int64_t stride, int64_t d) {
  Vec acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = zero();
  for (int64_t i = 0; i < d; i += kLanes) {
    const Vec query = load(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = fma(query, load(key + j * stride + i), acc[j]);
  }
  return sum_8(acc);
}

// Positions from .. to of a block's cache rows (`stride` values apart), `width` values from each,
// widened into `out` (float32, `width` apart, position o at o * width): a cached value read by
// several query heads or rows is widened once, not once by each.
template <typename C>
inline void widen_rows(const C* rows, int64_t from, int64_t to, int64_t stride, int64_t width,
                       float* out) {
  for (int64_t o = from; o < to; ++o)
    for (int64_t i = 0; i < width; i += kLanes)
      store(out + o * width + i, load(rows + o * stride + i));
}

// Attention of a group's rows' query heads of KV heads kv_begin .. kv_end (q, out: the first row's
// heads, of type T; the rows follow one another in both) over their cached positions (begin > 0: a
// sliding window, or a later chunk), the cache of type C (T, or bfloat16 under float32 rows, or fp8
// under either: --kv-cache-dtype). With `partial`, only a chunk's share of it, into
// partial[r * partial_row + h * partial_floats ..] for row r and the item's heads h (merged by
// merge_chunks). Each pass goes through the context a block at a time and reads, for every
// position, all those KV heads' K (or V) together: a cache row's 2 * KVH * D bytes in one place, so
// the hardware prefetchers follow it (a pass per KV head, reading each position's slices apart, ran
// at about a third of the memory bandwidth). Every row of the group uses a block while it is in L1,
// so the group reads the context once, not once a row; each row's arithmetic (which positions score
// eight at a time, the order of every sum) is what it would be alone, so its output's bits do not
// depend on its group.
template <typename T, typename C>
void attend(const Layout& l, const T* q, const Rows& rows, const C* cache, const int32_t* table,
            int64_t kv_begin, int64_t kv_end, float scale, Scratch& scratch, T* out,
            float* partial, int64_t partial_row) {
  const int64_t d = l.head_dim, group = l.group;
  const int64_t token_values = l.kv_heads * d;
  const int64_t heads = (kv_end - kv_begin) * group, first_head = kv_begin * group;
  const int64_t begin = rows.begin, length = rows.end(rows.count - 1);  // the longest row's
  // Row r's scores: [heads][its span] from r * row_scores (position t's score at t - begin).
  const int64_t row_scores = heads * (length - begin);
  for (int64_t r = 0; r < rows.count; ++r)
    to_floats(q + r * l.q_row + first_head * d, heads * d, scratch.q.data() + r * heads * d);
  const __m256 scale8 = _mm256_set1_ps(scale);
  // Scores eight positions of a block at a time, the rest one by one. Meanwhile the next
  // block's keys come into L1 and this block's values into L2, eight positions' with each
  // eight scored (of the first row): a request's blocks lie anywhere in the pool, where the
  // hardware prefetchers cannot see the next one coming, and a whole block's lines asked for at
  // once overflow the queue of misses in flight (a 16-row step over 1,000 scattered positions
  // each, 30 layers of KV in DRAM: 800-850 us a layer asking at the block's start, 684-708
  // spread).
  const int64_t slice_bytes = (kv_end - kv_begin) * d * sizeof(C);
  const int64_t first_block = begin / l.block_size;
  for (int64_t i = first_block, first = i * l.block_size; first < length;
       first += l.block_size, ++i) {
    const C* block = cache + table[i] * l.block_values;
    const C* values = block + l.value_offset;
    const int64_t block_end = std::min(l.block_size, length - first);
    const int64_t next_first = first + l.block_size;
    const int64_t next_count =
        next_first < length ? std::min(l.block_size, length - next_first) : 0;
    const C* next_keys = cache + table[next_count > 0 ? i + 1 : i] * l.block_values;
    const int64_t seen = std::max<int64_t>(0, begin - first);
    prefetch_rows<_MM_HINT_T0>(next_keys + kv_begin * d, std::min(seen, next_count),
                               token_values, slice_bytes);  // before a window's first position
    // Keys at `keys`, position o's KV head kv at keys + o * key_row + (kv - kv_begin) * d.
    const auto score_rows = [&](const auto* keys, int64_t key_row) {
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t row_length = rows.end(r), span = row_length - begin;
        if (first >= row_length) continue;
        const int64_t end = std::min(l.block_size, row_length - first);
        const bool asks = r == 0;  // the first row asks for the next lines as it scores
        float* scores = scratch.scores.data() + r * row_scores;
        const float* qs = scratch.q.data() + r * heads * d;
        int64_t o = seen;
        for (; o + 8 <= end; o += 8) {
          if (asks) {
            if (o < next_count)
              prefetch_rows<_MM_HINT_T0>(next_keys + o * token_values + kv_begin * d,
                                         std::min<int64_t>(8, next_count - o), token_values,
                                         slice_bytes);
            prefetch_rows<_MM_HINT_T1>(values + o * token_values + kv_begin * d, 8, token_values,
                                       slice_bytes);
          }
          for (int64_t kv = kv_begin; kv < kv_end; ++kv)
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = (kv - kv_begin) * group + g;
              const __m256 dots = dot_8_keys(qs + h * d, keys + o * key_row + (kv - kv_begin) * d,
                                             key_row, d);
              _mm256_storeu_ps(scores + h * span + (first + o - begin),
                               _mm256_mul_ps(dots, scale8));
            }
        }
        if (asks) {
          prefetch_rows<_MM_HINT_T0>(next_keys + o * token_values + kv_begin * d, next_count - o,
                                     token_values, slice_bytes);
          prefetch_rows<_MM_HINT_T1>(values + o * token_values + kv_begin * d, block_end - o,
                                     token_values, slice_bytes);
        }
        for (; o < end; ++o)
          for (int64_t kv = kv_begin; kv < kv_end; ++kv)
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = (kv - kv_begin) * group + g;
              scores[h * span + (first + o - begin)] =
                  dot(qs + h * d, keys + o * key_row + (kv - kv_begin) * d, d) * scale;
            }
      }
    };
    // Widened once where several rows read a key; for one row's query heads only in e4m3,
    // whose widening (five instructions) costs more than a trip through L1 (bfloat16's and
    // e5m2's, two and three, do not: python -m bench.attention_kernels, 1 x 4,000).
    const bool widen_keys =
        !std::is_same_v<C, float> && (rows.count > 1 || (std::is_same_v<C, e4m3> && group > 1));
    if (!widen_keys) {
      score_rows(block + kv_begin * d, token_values);
    } else {
      const int64_t width = (kv_end - kv_begin) * d;
      widen_rows(block + kv_begin * d, seen, block_end, token_values, width, scratch.block.data());
      score_rows(scratch.block.data(), width);
    }
  }
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t span = rows.end(r) - begin;
    float* row_partial = partial == nullptr ? nullptr : partial + r * partial_row;
    for (int64_t h = 0; h < heads; ++h) {
      float* head_scores = scratch.scores.data() + r * row_scores + h * span;
      if (row_partial == nullptr) {
        softmax(head_scores, span, sink_of(l, first_head + h));
        continue;
      }
      const float top = largest(head_scores, span);
      row_partial[h * partial_floats(l)] = top;
      row_partial[h * partial_floats(l) + 1] = exponentiate(head_scores, span, top, 0.0f);
    }
  }
  // out = probabilities . V, a block at a time: up to three heads and four vectors of features
  // together.
  float* mixed = scratch.out.data();  // row r's heads from r * heads * d
  std::fill(mixed, mixed + rows.count * heads * d, 0.0f);
  for (int64_t i = first_block, first = i * l.block_size; first < length;
       first += l.block_size, ++i) {
    const int64_t skip = std::max<int64_t>(0, begin - first);
    const C* block = cache + l.value_offset + table[i] * l.block_values + skip * token_values;
    // Values at `values`, position skip + t's KV head kv at values + t * value_row +
    // (kv - kv_begin) * d.
    const auto mix_rows = [&](const auto* values, int64_t value_row) {
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t row_length = rows.end(r), span = row_length - begin;
        if (first >= row_length) continue;
        const int64_t end = std::min(l.block_size, row_length - first);
        const float* scores = scratch.scores.data() + r * row_scores;
        float* row_mixed = mixed + r * heads * d;
        for (int64_t kv = kv_begin; kv < kv_end; ++kv)
          for (int64_t g0 = 0; g0 < group; g0 += 3) {
            const int64_t h = (kv - kv_begin) * group + g0;
            for (int64_t d0 = 0; d0 < d; d0 += 4 * kLanes)
              mix_slab(std::min<int64_t>(3, group - g0), std::min<int64_t>(4, (d - d0) / kLanes),
                       values + (kv - kv_begin) * d + d0, end - skip, value_row,
                       scores + h * span + (first + skip - begin), span, row_mixed + h * d + d0,
                       d);
          }
      }
    };
    // mix_slab loads a value once for up to three query heads of a row.
    if (std::is_same_v<C, float> || (rows.count == 1 && group <= 3)) {
      mix_rows(block + kv_begin * d, token_values);
    } else {
      const int64_t width = (kv_end - kv_begin) * d;
      widen_rows(block + kv_begin * d, 0, std::min(l.block_size, length - first) - skip,
                 token_values, width, scratch.block.data());
      mix_rows(scratch.block.data(), width);
    }
  }
  for (int64_t r = 0; r < rows.count; ++r) {
    const float* row_mixed = mixed + r * heads * d;
    if (partial == nullptr) {
      from_floats(row_mixed, heads * d, out + r * l.heads * d + first_head * d);
      continue;
    }
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(partial + r * partial_row + h * partial_floats(l) + 2, row_mixed + h * d,
                  d * sizeof(float));
  }
}
