// Time-series charts drawn on a canvas, by hand (no library: the pages load nothing from
// elsewhere). A chart keeps the rows of the last `seconds`, one per sample, each with a value
// per series (null: no value, drawn as a gap), and redraws itself when a row is added.
"use strict";

const Charts = (() => {
  const PALETTE = ["#2f7ed8", "#e4572e", "#17a398", "#f3a712", "#8e5ea2", "#6b8f71", "#c2185b"];

  // The smallest of 1, 2, 5 times a power of ten that is at least `value`.
  function niceCeiling(value) {
    if (!(value > 0)) {
      return 1;
    }
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 5, 10]) {
      if (step * power >= value) {
        return step * power;
      }
    }
    return 10 * power;
  }

  function format(value, unit) {
    if (value === null || value === undefined) {
      return "–";
    }
    const digits = Math.abs(value) >= 100 || Number.isInteger(value) ? 0 : 1;
    return `${value.toFixed(digits)}${unit}`;
  }

  class TimeChart {
    constructor(canvas, { seconds = 120, max = null, stacked = false, unit = "" } = {}) {
      this.canvas = canvas;
      this.seconds = seconds;
      this.max = max;
      this.stacked = stacked;
      this.unit = unit;
      this.series = []; // {key, label, color}, in the order first seen
      this.rows = []; // {time, values: {key: number|null}}
      this.legend = document.querySelector(`.legend[data-for="${canvas.id}"]`);
    }

    // Add one row: `values` maps each series' key to {label, value}.
    add(time, values) {
      const row = { time, values: {} };
      for (const [key, { label, value }] of Object.entries(values)) {
        if (!this.series.some((s) => s.key === key)) {
          this.series.push({ key, label, color: PALETTE[this.series.length % PALETTE.length] });
        }
        row.values[key] = value;
      }
      this.rows.push(row);
      while (this.rows.length && this.rows[0].time < time - this.seconds) {
        this.rows.shift();
      }
      this.draw();
      this.drawLegend(row);
    }

    // The top of the y axis: fixed, or rounded up from the largest value (or stacked sum) shown.
    top() {
      if (this.max !== null) {
        return this.max;
      }
      let largest = 0;
      for (const row of this.rows) {
        const values = this.series.map((s) => row.values[s.key] || 0);
        const height = this.stacked ? values.reduce((a, b) => a + b, 0) : Math.max(0, ...values);
        largest = Math.max(largest, height);
      }
      return niceCeiling(largest);
    }

    draw() {
      const canvas = this.canvas;
      const ratio = window.devicePixelRatio || 1;
      const width = canvas.clientWidth;
      const height = canvas.clientHeight;
      if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
        canvas.width = Math.round(width * ratio);
        canvas.height = Math.round(height * ratio);
      }
      const g = canvas.getContext("2d");
      g.setTransform(ratio, 0, 0, ratio, 0, 0);
      g.clearRect(0, 0, width, height);
      const style = getComputedStyle(canvas);
      const ink = style.getPropertyValue("--chart-ink").trim() || "#888";
      const grid = style.getPropertyValue("--chart-grid").trim() || "#ddd";
      const left = 58;
      const right = width - 8;
      const topY = 8;
      const bottom = height - 18;
      const top = this.top();
      const end = this.rows.length ? this.rows[this.rows.length - 1].time : 0;
      const x = (time) => right - ((end - time) / this.seconds) * (right - left);
      const y = (value) => bottom - (Math.min(value, top) / top) * (bottom - topY);

      g.font = "11px system-ui, sans-serif";
      g.lineWidth = 1;
      g.fillStyle = ink;
      g.strokeStyle = grid;
      g.textAlign = "right";
      g.textBaseline = "middle";
      for (const share of [0, 0.5, 1]) {
        const value = top * share;
        g.beginPath();
        g.moveTo(left, y(value));
        g.lineTo(right, y(value));
        g.stroke();
        g.fillText(format(value, this.unit), left - 4, y(value));
      }
      g.textAlign = "left";
      g.textBaseline = "alphabetic";
      g.fillText(`${this.seconds} s ago`, left, height - 4);
      g.textAlign = "right";
      g.fillText("now", right, height - 4);

      if (this.stacked) {
        this.drawStacked(g, x, y);
      } else {
        this.drawLines(g, x, y);
      }
    }

    drawLines(g, x, y) {
      g.lineWidth = 2;
      for (const s of this.series) {
        g.strokeStyle = s.color;
        g.beginPath();
        let drawing = false;
        for (const row of this.rows) {
          const value = row.values[s.key];
          if (value === null || value === undefined) {
            drawing = false;
            continue;
          }
          if (drawing) {
            g.lineTo(x(row.time), y(value));
          } else {
            g.moveTo(x(row.time), y(value));
            drawing = true;
          }
        }
        g.stroke();
      }
    }

    drawStacked(g, x, y) {
      const base = this.rows.map(() => 0);
      for (const s of this.series) {
        const upper = this.rows.map((row, i) => base[i] + (row.values[s.key] || 0));
        if (this.rows.length) {
          g.fillStyle = s.color;
          g.beginPath();
          this.rows.forEach((row, i) => g.lineTo(x(row.time), y(upper[i])));
          for (let i = this.rows.length - 1; i >= 0; i -= 1) {
            g.lineTo(x(this.rows[i].time), y(base[i]));
          }
          g.closePath();
          g.fill();
        }
        upper.forEach((value, i) => {
          base[i] = value;
        });
      }
    }

    drawLegend(row) {
      if (!this.legend) {
        return;
      }
      this.legend.replaceChildren(
        ...this.series.map((s) => {
          const item = document.createElement("li");
          const swatch = document.createElement("span");
          swatch.className = "swatch";
          swatch.style.background = s.color;
          item.append(swatch, `${s.label}: ${format(row.values[s.key], this.unit)}`);
          return item;
        }),
      );
    }
  }

  return { TimeChart, format };
})();
