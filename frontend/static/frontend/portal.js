// Draws the team page's charts with the vendored Chart.js from the JSON the page embeds.
// The same figures are in tables next to each chart, so the page reads without scripts.
(function () {
  "use strict";
  var source = document.getElementById("chart-data");
  if (!source || typeof Chart === "undefined") {
    return;
  }
  var data = JSON.parse(source.textContent);
  var colours = { allocated: "#8aa9d6", utilised: "#0a58ca", remaining: "#0a58ca", ideal: "#6e7781" };
  // A fresh object per chart: Chart.js writes its resolved scales into the options it is
  // given, so a shared one made the bar chart inherit the line chart's unpadded x axis (the
  // first and last bars were cut in half).
  function options(xAxis) {
    return {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      interaction: { mode: "index", intersect: false },
      scales: {
        x: xAxis,
        y: { beginAtZero: true, title: { display: true, text: "GPU-hours" } },
      },
    };
  }
  var builders = {
    usage: function (figures) {
      return {
        type: "bar",
        data: {
          labels: figures.labels,
          datasets: [
            { label: "Allocated", data: figures.allocated, backgroundColor: colours.allocated },
            { label: "Utilised", data: figures.utilised, backgroundColor: colours.utilised },
          ],
        },
        // Half a category of space at each end, so the first and last bars sit inside the plot.
        options: options({ offset: true, grid: { offset: true } }),
      };
    },
    burn: function (figures) {
      return {
        type: "line",
        data: {
          labels: figures.labels,
          datasets: [
            { label: "Remaining budget", data: figures.remaining, borderColor: colours.remaining,
              backgroundColor: colours.remaining, pointRadius: 2 },
            { label: "Steady burn", data: figures.ideal, borderColor: colours.ideal,
              borderDash: [6, 4], pointRadius: 0 },
          ],
        },
        options: options({}),
      };
    },
  };
  document.querySelectorAll("canvas[data-chart]").forEach(function (canvas) {
    var name = canvas.getAttribute("data-chart");
    if (data[name] && builders[name]) {
      new Chart(canvas, builders[name](data[name]));
    }
  });
})();
