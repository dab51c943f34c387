// Charts for the endpoint page (live metrics) and the usage page (tokens per day), drawn with uPlot.
(() => {
  const PALETTE = ["#4f46e5", "#0f9d58", "#d97706", "#db2777", "#0891b2", "#7c3aed", "#65a30d", "#dc2626", "#64748b"];

  function compact(value) {
    if (value == null) return "";
    const abs = Math.abs(value);
    if (abs >= 1e9) return +(value / 1e9).toFixed(1) + "B";
    if (abs >= 1e6) return +(value / 1e6).toFixed(1) + "M";
    if (abs >= 1e3) return +(value / 1e3).toFixed(1) + "k";
    return +value.toFixed(2) + "";
  }

  function size(el) {
    return { width: Math.max(el.clientWidth, 200), height: el.classList.contains("tall") ? 280 : 170 };
  }

  function plot(el, series, data, opts = {}) {
    el.innerHTML = "";
    const chart = new uPlot({
      ...size(el),
      cursor: { drag: { x: false, y: false } },
      legend: { show: series.length > 1 || opts.legend === true },
      scales: { x: { time: true, range: opts.padX ? (u, min, max) => [min - opts.padX, max + opts.padX] : undefined }, y: { range: (u, min, max) => [0, Math.max(max || 0, opts.minMax || 1) * 1.1] } },
      axes: [
        { stroke: "#6b6b80", grid: { stroke: "#eeeef5" }, ticks: { stroke: "#e3e3ee" } },
        { stroke: "#6b6b80", grid: { stroke: "#eeeef5" }, ticks: { stroke: "#e3e3ee" }, size: 56,
          values: (u, ticks) => ticks.map(compact) },
      ],
      series: [{}, ...series.map((s, i) => ({
        label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 2,
        fill: opts.fill ? (s.color || PALETTE[i % PALETTE.length]) + "1a" : undefined,
        spanGaps: opts.spanGaps === true, points: { show: opts.points === true, size: 5 },
        paths: opts.bars ? uPlot.paths.bars({ size: [0.7, 40] }) : opts.steps ? uPlot.paths.stepped({ align: 1 }) : undefined,
      }))],
    }, data, el);
    new ResizeObserver(() => chart.setSize(size(el))).observe(el);
    return chart;
  }

  // --- endpoint page -----------------------------------------------------------------
  const charts = document.querySelector("[data-metrics-url]");
  if (charts) {
    let minutes = 60;
    const el = (name) => charts.querySelector(`[data-chart="${name}"]`);
    async function refresh() {
      let body;
      try {
        const response = await fetch(`${charts.dataset.metricsUrl}?minutes=${minutes}`, { credentials: "same-origin" });
        if (!response.ok) return;
        body = await response.json();
      } catch { return; }
      const s = body.series;
      plot(el("requests"), [{ label: "requests" }], [s.t, s.requests], { fill: true, bars: true });
      plot(el("latency"), [{ label: "p50" }, { label: "p95", color: "#d97706" }], [s.t, s.p50_ms, s.p95_ms], { spanGaps: true, points: true });
      plot(el("tokens_per_s"), [{ label: "tokens/s", color: "#0f9d58" }], [s.t, s.tokens_per_s], { fill: true });
      plot(el("replicas"), [{ label: "replicas", color: "#0891b2" }], [s.t, s.replicas], { steps: true, fill: true });
    }
    document.querySelectorAll("[data-window]").forEach((button) => button.addEventListener("click", () => {
      minutes = Number(button.dataset.window);
      document.querySelectorAll("[data-window]").forEach((b) => {
        b.classList.toggle("active", b === button);
        b.setAttribute("aria-pressed", b === button ? "true" : "false");
      });
      refresh();
    }));
    refresh();
    setInterval(() => { if (document.visibilityState === "visible") refresh(); }, 15000);
  }

  // --- usage page -------------------------------------------------------------------
  const usage = document.querySelector("[data-usage-chart]");
  if (usage) {
    const body = JSON.parse(document.getElementById("usage-chart-data").textContent);
    const names = Object.keys(body.series);
    if (!names.length) {
      usage.innerHTML = '<p class="muted chart-empty">No tokens in this range.</p>';
    } else {
      const single = names.length === 1;  // one group: bars per day; several: a line each
      plot(usage, names.map((name) => ({ label: name })), [body.t, ...names.map((n) => body.series[n])],
        { legend: true, fill: single, bars: single, points: !single, padX: 43200 });
    }
  }
})();
