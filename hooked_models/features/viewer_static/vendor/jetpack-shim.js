// What transformer-circuits.pub's jetpack build adds to d3-jetpack's `conventions` and circuit-tracer's viewer
// uses (that build has no npm package; d3-jetpack 2.1.0 with d3-collection's `nest` stands in for the rest).
(function () {
  var conventions = d3.conventions
  d3.conventions = function (options) {
    var c = conventions(options)
    c.drawAxis = function () { return d3.drawAxis(c) }
    c.totalWidth = c.width + c.margin.left + c.margin.right
    c.totalHeight = c.height + c.margin.top + c.margin.bottom
    return c
  }
})()
